"""``KVScorer``: a transformers causal LM as a stage's ``Scorer`` (the protocols of what a stage
computes with, ``Scorer`` and ``Proposer``, are in stage/ports.py)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence

import torch

from pipespec_mpi.models.kv_cache import preallocated_cache

log = logging.getLogger("pipespec_mpi")


class KVScorer:
    """A transformers causal LM plus a KV cache rolled back with ``crop``.

    The cache is preallocated for prompt + ``room`` positions (``models/kv_cache.py``): appending
    copies only the new tokens and rolling back moves an index. Llama-family models run the lean
    forward of ``models/cpu/lean.py`` (bitwise the transformers forward, without its framework
    overhead) unless ``lean`` is False; build the scorer once the model's modules are final
    (linears swapped, attention implementation set).
    """

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        device: torch.device,
        lean: bool = True,
        exact_rows: bool | None = False,
    ) -> None:
        self.name = name
        self.model = model.eval()
        self.device = device
        self._cache = preallocated_cache(model.config, 1)
        self._len = 0
        self._lean = None
        # Rows a decoding forward computes at once: the flat kernel's, where the model has it.
        # Its linears give a row the same result whatever rows travel with it, up to MAX_ROWS; a
        # wider forward would run torch's GEMM, whose rounding differs, so a verification of 16
        # proposals (17 rows) could have tipped a near-tie away from what one-token steps (AR)
        # commit. Split into kernel-sized pieces it stays bitwise AR's, and costs less
        # (docs/notebook.md, "Measurements behind the code's choices"). Prefill keeps one GEMM
        # forward (AR's too).
        self._rows = _kernel_rows(model)
        why = "transformers forward (lean=False)"
        if lean:
            from pipespec_mpi.models.cpu.lean import build_lean

            self._lean, why = build_lean(self.model)
        log.info("%s: %s", name, why)
        # Decoding forwards: every row's attention as its own token's (lean.py ``rows_alone``), so
        # each row is bitwise its one-token forward where the linears are row-independent (the
        # flat kernel). With the row kernel that is also the cheaper attention (docs/notebook.md,
        # "Measurements behind the code's choices"), so None turns it on wherever that kernel
        # runs. Without it (a GPU) one SDPA call per row would buy nothing where the linears round
        # rows differently anyway (torch GEMM): off there.
        kernel = self._lean is not None and self._lean.rows_kernel is not None
        if exact_rows is None:
            exact_rows = kernel
        self.exact_rows = exact_rows and (kernel or self._rows is not None)

    @property
    def thread_invariant(self) -> bool:
        """Its logits are bitwise the same on any number of threads: the lean forward with the
        row kernel's attention for every row (prefill too) and every linear layer on the CPU
        kernels (models/cpu/flat_linear.py, lowbit.py). Elsewhere (torch's GEMM and SDPA, a GPU)
        they may differ in the last bit with the thread count
        (tests/unit/models/cpu/test_kernel_threads.py)."""
        if self._lean is None or self._lean.rows_kernel is None or not self.exact_rows:
            return False
        from pipespec_mpi.models.cpu.flat_linear import FlatLinear
        from pipespec_mpi.models.cpu.lowbit import LowBitLinear

        def on_kernels(m: torch.nn.Module) -> bool:
            if isinstance(m, FlatLinear):
                return m.tiled
            if isinstance(m, LowBitLinear):
                return m._fn is not None and not m.dense
            return isinstance(m, torch.nn.Embedding) or "RMSNorm" in type(m).__name__

        # every module holding weights (torch's or quantized linears among them) must be one of these
        return all(on_kernels(m) for m in self.model.modules() if hasattr(m, "weight") or hasattr(m, "w0"))

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_context(self) -> int | None:
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if n else None

    def prefill(self, prompt: Sequence[int], room: int = 0) -> None:
        self._cache = preallocated_cache(self.model.config, len(prompt) + room)
        self._len = 0
        if len(prompt) > 1:
            self._forward_once(list(prompt[:-1]), keep=1, rows_alone=self.exact_rows)

    def _forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        """Logits [keep, V] of the last ``keep`` of ``tokens``, appended to the cache; forwards
        wider than ``_rows`` run as pieces of at most ``_rows`` tokens (the kept rows are a
        suffix, so each piece keeps its own tail of them)."""
        rows = self._rows
        if rows is None or len(tokens) <= rows:
            return self._forward_once(tokens, keep, self.exact_rows)
        parts = []
        first_kept = len(tokens) - keep
        for start in range(0, len(tokens), rows):
            end = min(start + rows, len(tokens))
            kept = end - max(start, first_kept)
            # a piece before the kept rows keeps one (keep 0 would mean every row) and drops it
            logits = self._forward_once(tokens[start:end], max(kept, 1), self.exact_rows)
            if kept > 0:
                parts.append(logits)
        return torch.cat(parts)

    @torch.inference_mode()
    def _forward_once(self, tokens: list[int], keep: int, rows_alone: bool = False) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, T]
        if self._lean is not None:
            logits = self._lean.forward(ids, self._cache, keep, rows_alone=rows_alone)
        else:
            logits = self.model(input_ids=ids, cache=self._cache, use_cache=True, logits_to_keep=keep).logits
        self._len += len(tokens)
        return logits[0]  # [keep, V]

    def logits(self, seq: Sequence[int], proposal: Sequence[int]) -> torch.Tensor:
        new = self._new_tokens(seq, proposal)
        return self._forward(new, keep=len(proposal) + 1).float()

    def truncate(self, length: int) -> None:
        if self._len > length:
            self._cache.crop(length - self._len)  # transformers 5: negative = tokens to remove
            self._len = length

    @property
    def batchable(self) -> bool:
        """Its slots' forwards can run as one (a lean forward with ``forward_batch``)."""
        return self._lean is not None and self._lean.batchable

    def for_slot(self) -> KVScorer:
        """Another sequence on the same weights (a slot of batched decoding): shares this
        scorer's model and lean forward, owns its KV cache."""
        other = copy.copy(self)
        other._cache = preallocated_cache(self.model.config, 1)
        other._len = 0
        return other

    def _new_tokens(self, seq: Sequence[int], proposal: Sequence[int]) -> list[int]:
        if self._len >= len(seq):
            raise RuntimeError(f"{self.name}: cache holds {self._len} >= {len(seq)} positions")
        return list(seq[self._len :]) + list(proposal)


def _kernel_rows(model: torch.nn.Module) -> int | None:
    """The most rows a forward of ``model`` computes row-independently (the flat kernel's), or
    None where no layer runs the flat kernel (torch or GPU numerics: no split pays there)."""
    from pipespec_mpi.models.cpu.flat_linear import MAX_ROWS, FlatLinear

    return MAX_ROWS if any(isinstance(m, FlatLinear) for m in model.modules()) else None


Request = tuple[object, Sequence[int], Sequence[int]]  # (scorer, seq, proposal) as in Scorer.logits


def score_batch(requests: Sequence[Request]) -> list[torch.Tensor]:
    """``scorer.logits(seq, proposal)`` for every request, each [len(proposal)+1, V] float32.

    Requests whose scorers are slots of one ``KVScorer`` with a lean forward run as batched
    forwards (``LeanLlama.forward_batch``: the weights are read once for all rows), packed in
    order into groups of at most ``LeanLlama.fuse_rows`` (16) new tokens, the flat kernel's
    rows, so that every row is bitwise its sequence's own forward (greedy stays lossless). Other
    requests (other scorers, a longer catch-up forward) run one forward each.
    """
    from pipespec_mpi.models.portable import PortableScorer, score_many

    out: list[torch.Tensor | None] = [None] * len(requests)
    engines: dict[int, list[int]] = {}  # the portable engine's slots: one forward per engine
    for i, (sc, _, _) in enumerate(requests):
        if isinstance(sc, PortableScorer):
            engines.setdefault(id(sc.engine), []).append(i)
    for idx in engines.values():
        for i, rows in zip(idx, score_many([requests[i] for i in idx]), strict=True):
            out[i] = rows
    group: list[tuple[int, KVScorer, list[int], int]] = []  # (index, scorer, new tokens, keep)

    def flush() -> None:
        if not group:
            return
        if len(group) == 1:
            i, sc, new, keep = group[0]
            out[i] = sc._forward(new, keep).float()
        else:
            lean = group[0][1]._lean
            logits = lean.forward_batch(
                [g[2] for g in group], [g[1]._cache for g in group], [g[3] for g in group],
                rows_alone=group[0][1].exact_rows,
            )  # fmt: skip
            start = 0
            for i, sc, new, keep in group:
                sc._len += len(new)
                out[i] = logits[start : start + keep].float()
                start += keep
        group.clear()

    for i, (sc, seq, proposal) in enumerate(requests):
        if out[i] is not None:
            continue
        batchable = isinstance(sc, KVScorer) and sc.batchable
        lean = sc._lean if batchable else None
        new = sc._new_tokens(seq, proposal) if batchable else []
        if not batchable or len(new) > lean.fuse_rows:
            out[i] = sc.logits(seq, proposal)
            continue
        rows = sum(len(g[2]) for g in group) + len(new)
        if group and (group[0][1]._lean is not lean or rows > lean.fuse_rows):
            flush()
        group.append((i, sc, new, len(proposal) + 1))
    flush()
    return out  # type: ignore[return-value]
