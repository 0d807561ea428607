"""``EngineScorer``: a stage's ``Scorer`` on the engine (models/engine.py), any device.

``Engine`` is the host side of one model's engine: its slots' lengths (a rollback moves one) and
``run``, which lays the slots' new tokens out as the attention back-end wants them (``Batch``)
and runs them in as few forwards as keep every row exact: where the attention is exact and the
linears compute each row as if alone only up to ``max_rows`` rows (the CPU's flat kernel), the
rows go in forwards of at most that many, a longer request as pieces; elsewhere all in one. One
host-to-device copy of the rows' indices per forward; logits stay on the device.
Slots of batched decoding are scorers on one ``Engine`` (``for_slot``); ``score_many`` runs
their requests together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.fx.experimental import _config as fx_config

from pipespec_mpi.models.engine import KVCache, Weights, decoder_layer, forward, silu_by_rows
from pipespec_mpi.models.rows import Batch

# the widest step the compiled forward runs (wider: eager, as a prefill)
MAX_GRAPH_WIDTH = 64


@dataclass(frozen=True)
class Request:
    """New tokens of one slot, appended to its sequence; the logits of the last ``keep`` returned."""

    slot: int
    tokens: list[int]
    keep: int


class Engine:
    """One model's weights and plug-ins, the KV cache of its slots, and each slot's length."""

    def __init__(self, weights: Weights, max_context: int | None = None, compiled: bool = False) -> None:
        self.w = weights
        self.compiled = compiled
        self.step = compile_forward(weights) if compiled else forward
        self.max_context = max_context
        self.cache = KVCache.empty(weights, 0, 1)
        self.lengths: list[int] = []
        # rows per forward: bounded only where exactness needs it (the linears' promise)
        self.max_rows = weights.max_rows if weights.attention.exact else None

    def describe(self) -> str:
        """Which forward and plug-ins this engine runs (logged at load, kept in the records)."""
        w = self.w
        kinds = sorted({_linear_name(m) for m in w.linears()})
        act = "SiLU by rows" if w.act is silu_by_rows else "SiLU"
        rows = f", {self.max_rows} rows a forward" if self.max_rows else ""
        mode = "compiled" if self.compiled else "eager"
        return (
            f"engine on {w.device}, {str(w.dtype).removeprefix('torch.')}: linears {'+'.join(kinds)}, "
            f"attention {w.attention!r}, {act}{rows}, {mode}"
        )

    def new_slot(self) -> int:
        self.lengths.append(0)
        return len(self.lengths) - 1

    @torch.inference_mode()
    def _fit(self, need: int) -> None:
        """Room for every slot and ``need`` positions each (plus the scratch one). The cache is
        made in inference mode: views and writes of inference tensors skip autograd's view and
        version tracking (a normal tensor's cost ~20% on every op of a CPU step)."""
        slots, cap = len(self.lengths), self.cache.capacity
        if need + 1 > cap:
            cap = max(need + 1, 2 * cap)
        if slots != self.cache.slots or cap != self.cache.capacity:
            self.cache = self.cache.resized(self.w, slots, cap)

    def begin(self, slot: int, room: int) -> None:
        """Slot ``slot`` starts a sequence that may reach ``room`` positions."""
        self.lengths[slot] = 0
        self._fit(room)

    def warm_up(self, slots: int = 1) -> float:
        """Under ``device.compile``, compile the forward's graphs before the first prompt: one
        forward of each kind of shape a stage's schedule has (one slot and several where
        ``slots`` > 1, one row and several; a few positions in), so that no prompt waits for the
        compiler (each new kind of shape would, for tens of seconds: docs/gpu.md, "Compile
        time"). Runs on slots 0 and 1 (made for it where missing, given back after), at load,
        before any prompt: nothing it writes is ever read. Seconds taken."""
        if not self.compiled:
            return 0.0
        t0 = time.perf_counter()
        saved = list(self.lengths)
        n = min(max(slots, 1), 2)
        while len(self.lengths) < n:
            self.new_slot()
        try:
            for k in sorted({1, n}):
                for width in (1, 2):
                    self.lengths[:k] = [3] * k
                    self.run([Request(s, [0] * width, width) for s in range(k)])
        finally:
            self.lengths[:] = saved
        return time.perf_counter() - t0

    def prefill(self, slot: int, tokens: Sequence[int]) -> None:
        """A prompt's tokens into the slot's cache: one forward, whatever its width (eager: a
        prompt's width is its own, and its forward is long enough that launches do not count)."""
        self._forward([Request(slot, list(tokens), 1)], prefill=True)

    def run(self, requests: Sequence[Request]) -> list[torch.Tensor]:
        """Each request's logits [keep, V] (its tokens appended to its slot's sequence)."""
        out: list[torch.Tensor | None] = [None] * len(requests)
        limit = self.max_rows
        group: list[int] = []

        def flush() -> None:
            for i, logits in zip(group, self._forward([requests[i] for i in group]), strict=True):
                out[i] = logits
            group.clear()

        for i, req in enumerate(requests):
            if limit is None:
                group.append(i)
            elif len(req.tokens) > limit:  # alone, as pieces of at most ``limit`` rows
                out[i] = self._pieces(req, limit)
            else:
                if sum(len(requests[j].tokens) for j in group) + len(req.tokens) > limit:
                    flush()
                group.append(i)
        if group:
            flush()
        return out  # type: ignore[return-value]

    def _pieces(self, req: Request, limit: int) -> torch.Tensor:
        """A request wider than ``limit`` rows as forwards of at most ``limit`` (the kept rows are
        a suffix: each piece keeps its own tail of them)."""
        parts = []
        first_kept = len(req.tokens) - req.keep
        for start in range(0, len(req.tokens), limit):
            end = min(start + limit, len(req.tokens))
            kept = end - max(start, first_kept)
            # a piece before the kept rows keeps one and drops it
            (logits,) = self._forward([Request(req.slot, req.tokens[start:end], max(kept, 1))])
            if kept > 0:
                parts.append(logits)
        return torch.cat(parts)

    @torch.inference_mode()
    def _forward(self, requests: Sequence[Request], prefill: bool = False) -> list[torch.Tensor]:
        """One forward of ``requests`` (each slot at most once)."""
        self._fit(max(self.lengths[r.slot] + len(r.tokens) for r in requests))
        step = forward if prefill or max(len(r.tokens) for r in requests) > MAX_GRAPH_WIDTH else self.step
        if self.w.attention.layout == "grid":
            b, keeps = self._grid(requests, bucketed=step is not forward)
        else:
            b, keeps = self._ragged(requests)
        logits = step(self.w, self.cache, b)
        out, at = [], 0
        for r, n in zip(requests, keeps, strict=True):
            self.lengths[r.slot] += len(r.tokens)
            out.append(logits[at : at + n])
            at += n
        return out

    def _ragged(self, requests: Sequence[Request]) -> tuple[Batch, list[int]]:
        """Each request's rows contiguous, in order."""
        tokens, pos, slot, keep, seqs, bounds = [], [], [], [], [], [0]
        for r in requests:
            start, n = self.lengths[r.slot], len(r.tokens)
            keep.extend(range(len(tokens) + n - r.keep, len(tokens) + n))
            tokens.extend(r.tokens)
            pos.extend(range(start, start + n))
            slot.extend([r.slot] * n)
            seqs.append((r.slot, start, n))
            bounds.append(bounds[-1] + n)
        layout = {"seqs": tuple(seqs), "bounds": tuple(bounds)}
        b = Batch.of(self.w.device, tokens, pos, slot, pos, keep, **layout)
        return b, [r.keep for r in requests]

    def _grid(self, requests: Sequence[Request], bucketed: bool) -> tuple[Batch, list[int]]:
        """The slots' range as a grid of ``width`` rows each: a slot's real rows first, the rest
        padding at position 0 writing the scratch position; slots not asked are all padding.
        ``bucketed`` (the compiled forward): slots from the first, their count, the width and the
        attended length each a power of two, so that a few shapes serve every step."""
        first, last = min(r.slot for r in requests), max(r.slot for r in requests)
        width = max(len(r.tokens) for r in requests)
        end = max(self.lengths[r.slot] + len(r.tokens) for r in requests)
        scratch = self.cache.capacity - 1
        span = scratch
        if bucketed:
            first, last = 0, min(bucket(last + 1), self.cache.slots) - 1
            width, span = bucket(width), min(bucket(end), scratch)
        n_rows = (last - first + 1) * width
        tokens, pos, write = [0] * n_rows, [0] * n_rows, [scratch] * n_rows
        slot = [first + i // width for i in range(n_rows)]
        keep = []
        for r in requests:
            at, start, n = (r.slot - first) * width, self.lengths[r.slot], len(r.tokens)
            tokens[at : at + n] = r.tokens
            pos[at : at + n] = write[at : at + n] = range(start, start + n)
            keep.extend(range(at + n - r.keep, at + n))
        layout = {"grid_slots": slice(first, last + 1), "width": width, "span": span}
        b = Batch.of(self.w.device, tokens, pos, slot, write, keep, **layout)
        return b, [r.keep for r in requests]


def compile_forward(
    w: Weights, backend: str | Callable = "inductor"
) -> Callable[[Weights, KVCache, Batch], torch.Tensor]:
    """``forward`` as a job runs it under ``device.compile``: the decoder layer compiled whole
    (``fullgraph``) once for every layer, shapes dynamic, each size its own symbol (no duck
    sizing: two sizes equal once are not assumed equal ever after); the embedding and the head
    run eager around it. The whole forward compiled took minutes a graph, growing with the layers
    (docs/gpu.md, "Compile time"). On CUDA each layer's graphs are captured (``reduce-overhead``;
    the weights and the cache buffers keep static addresses). ``backend``: tests count graphs on
    a cheaper one."""
    mode = "reduce-overhead" if w.device.type == "cuda" else None
    layer = torch.compile(decoder_layer, dynamic=True, fullgraph=True, mode=mode, backend=backend)

    def run(w: Weights, cache: KVCache, b: Batch) -> torch.Tensor:
        if mode is not None:  # a new replay: the last step's graph outputs are no longer read
            torch.compiler.cudagraph_mark_step_begin()
        with fx_config.patch(use_duck_shape=False):
            return forward(w, cache, b, layer=layer)

    return run


def bucket(n: int) -> int:
    """The power of two at or above ``n``: the few widths and attended lengths a compiled forward
    sees (each a graph to compile once, and on CUDA one to capture)."""
    return 1 << max(0, n - 1).bit_length()


def _linear_name(m: object) -> str:
    """A linear plug-in's kind as the records name it (e.g. FlatLinear[q8 blocks])."""
    name = type(m).__name__
    if type(m).__module__.startswith("torch.ao.nn."):  # torch's quantized modules: say which
        name = ".".join(type(m).__module__.removeprefix("torch.ao.nn.").split(".")[:2]) + "." + name
    fmt = getattr(getattr(m, "blocks", None), "fmt", None) or getattr(m, "fmt", None)
    if name == "Concat":
        return "+".join(sorted({_linear_name(p) for p in m.parts}))  # type: ignore[attr-defined]
    return f"{name}[{fmt}]" if fmt else name


class EngineScorer:
    """A sequence (slot) of an ``Engine``: the stage's ``Scorer`` (stage/ports.py)."""

    batchable = True

    def __init__(self, name: str, engine: Engine, slot: int | None = None) -> None:
        self.name = name
        self.engine = engine
        self.slot = engine.new_slot() if slot is None else slot

    @property
    def backend(self) -> Engine:
        return self.engine

    def describe(self) -> str:
        return self.engine.describe()

    @property
    def device(self) -> torch.device:
        return self.engine.w.device

    @property
    def vocab_size(self) -> int:
        return self.engine.w.arch.vocab

    @property
    def max_context(self) -> int | None:
        return self.engine.max_context

    @property
    def length(self) -> int:
        """Positions in this slot's cache."""
        return self.engine.lengths[self.slot]

    @property
    def compiled(self) -> bool:
        """Its forward runs compiled (``device.compile``)."""
        return self.engine.compiled

    @property
    def thread_invariant(self) -> bool:
        """Its logits are bitwise the same on any number of threads: every linear, the attention
        and the activation on the CPU kernels (models/cpu/plugins.py)."""
        from pipespec_mpi.models.cpu.plugins import thread_invariant

        return thread_invariant(self.engine.w)

    def prefill(self, prompt: Sequence[int], room: int = 0) -> None:
        self.engine.begin(self.slot, len(prompt) + room)
        if len(prompt) > 1:
            self.engine.prefill(self.slot, list(prompt[:-1]))

    def request(self, seq: Sequence[int], proposal: Sequence[int]) -> Request:
        """What ``Engine.run`` computes for ``logits(seq, proposal)``."""
        if self.length >= len(seq):
            raise RuntimeError(f"{self.name}: cache holds {self.length} >= {len(seq)} positions")
        return Request(self.slot, [*seq[self.length :], *proposal], len(proposal) + 1)

    def logits(self, seq: Sequence[int], proposal: Sequence[int]) -> torch.Tensor:
        return self.engine.run([self.request(seq, proposal)])[0]

    def score_many(
        self, requests: Sequence[tuple[EngineScorer, Sequence[int], Sequence[int]]]
    ) -> list[torch.Tensor]:
        """``logits(seq, proposal)`` of slots of this scorer's engine, in as few forwards as it can."""
        if any(sc.engine is not self.engine for sc, _, _ in requests):
            raise ValueError("score_many: requests of one engine only")
        return self.engine.run([sc.request(seq, proposal) for sc, seq, proposal in requests])

    def warm_up(self, slots: int = 1) -> float:
        """``Engine.warm_up`` (at load, before any prompt)."""
        return self.engine.warm_up(slots)

    def truncate(self, length: int) -> None:
        lengths = self.engine.lengths
        lengths[self.slot] = min(lengths[self.slot], length)

    def for_slot(self) -> EngineScorer:
        return EngineScorer(self.name, self.engine)
