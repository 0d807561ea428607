"""``PortableScorer``: a stage's ``Scorer`` on the portable engine (models/engine.py), any device.

``Engine`` is the host side of one model's engine: its slots' lengths (a rollback moves one),
and ``run``, which packs the slots' new tokens into one forward: one host-to-device copy of the
token ids, logits back on the device (the verifier takes what the protocol sends from them:
speculative/greedy.py ``accept``). Slots of batched decoding are scorers on the same ``Engine``
(``for_slot``); ``score_many`` runs their requests as one forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipespec_mpi.models.engine import KVCache, Weights, forward, rope_table


class Engine:
    """One model's weights, the KV cache of its slots, and each slot's length."""

    def __init__(self, weights: Weights, max_context: int | None = None, compiled: bool = False) -> None:
        self.w = weights
        # the forward, or the forward under torch.compile (whole: it has no graph break)
        self.step = torch.compile(forward, dynamic=True) if compiled else forward
        self.max_context = max_context
        self.cache = KVCache.empty(weights.arch, 0, 1, weights.device, weights.dtype)
        self.cos, self.sin = rope_table(weights, 1)
        self.lengths: list[int] = []

    def new_slot(self) -> int:
        self.lengths.append(0)
        return len(self.lengths) - 1

    def _fit(self, need: int) -> None:
        """Room for every slot and ``need`` positions each (plus the scratch one)."""
        slots, cap = len(self.lengths), self.cache.capacity
        if need + 1 > cap:
            cap = max(need + 1, 2 * cap)
        if slots != self.cache.slots or cap != self.cache.capacity:
            self.cache = self.cache.resized(slots, cap)
            if cap > self.cos.shape[0]:
                self.cos, self.sin = rope_table(self.w, cap)

    def begin(self, slot: int, room: int) -> None:
        """Slot ``slot`` starts a sequence that may reach ``room`` positions."""
        self.lengths[slot] = 0
        self._fit(room)

    def run(self, requests: Sequence[tuple[int, Sequence[int], int]]) -> list[torch.Tensor]:
        """For each (slot, new tokens, keep): the logits [keep, V] of the last ``keep`` new tokens,
        appended to the slot's sequence; the slots' rows in one forward."""
        first = min(r[0] for r in requests)
        last = max(r[0] for r in requests)
        width = max(len(r[1]) for r in requests)
        self._fit(max(self.lengths[s] + len(t) for s, t, _ in requests))
        n = last - first + 1
        host = torch.zeros((n, width + 2), dtype=torch.long)  # [tokens..., start, count] per slot
        for s, toks, _ in requests:
            host[s - first, : len(toks)] = torch.tensor(list(toks), dtype=torch.long)
            host[s - first, width] = self.lengths[s]
            host[s - first, width + 1] = len(toks)
        dev = host.to(self.w.device)  # the one host-to-device copy
        last_only = len(requests) == 1 and requests[0][2] == 1  # a prefill: one row's logits
        logits = self.step(
            self.w, self.cache, slice(first, last + 1), dev[:, :width], dev[:, width], dev[:, width + 1],
            self.cos, self.sin, last_only=last_only,
        )  # fmt: skip
        out = []
        for s, toks, keep in requests:
            self.lengths[s] += len(toks)
            rows = logits[s - first]
            out.append(rows[None] if last_only else rows[len(toks) - keep : len(toks)])
        return out


class PortableScorer:
    """A sequence (slot) of an ``Engine``: the stage's ``Scorer`` (stage/ports.py)."""

    thread_invariant = False  # torch's GEMM and SDPA: every method computes on AR's threads
    batchable = True

    def __init__(self, name: str, engine: Engine, slot: int | None = None) -> None:
        self.name = name
        self.engine = engine
        self.slot = engine.new_slot() if slot is None else slot

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
    def _len(self) -> int:
        return self.engine.lengths[self.slot]

    def prefill(self, prompt: Sequence[int], room: int = 0) -> None:
        self.engine.begin(self.slot, len(prompt) + room)
        if len(prompt) > 1:
            self.engine.run([(self.slot, list(prompt[:-1]), 1)])

    def request(self, seq: Sequence[int], proposal: Sequence[int]) -> tuple[int, list[int], int]:
        """What ``Engine.run`` computes for ``logits(seq, proposal)``."""
        if self._len >= len(seq):
            raise RuntimeError(f"{self.name}: cache holds {self._len} >= {len(seq)} positions")
        return self.slot, [*seq[self._len :], *proposal], len(proposal) + 1

    def logits(self, seq: Sequence[int], proposal: Sequence[int]) -> torch.Tensor:
        return self.engine.run([self.request(seq, proposal)])[0]

    def truncate(self, length: int) -> None:
        lengths = self.engine.lengths
        lengths[self.slot] = min(lengths[self.slot], length)

    def for_slot(self) -> PortableScorer:
        return PortableScorer(self.name, self.engine)


def score_many(requests: Sequence[tuple[PortableScorer, Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
    """``logits(seq, proposal)`` of slots of one engine, as one forward."""
    engine = requests[0][0].engine
    if any(sc.engine is not engine for sc, _, _ in requests):
        raise ValueError("score_many: requests of one engine only")
    return engine.run([sc.request(seq, proposal) for sc, seq, proposal in requests])
