"""The row attention kernel as the engine's CPU attention.

``rows_kernel``: causal attention of new rows over each sequence's cache with every row computed
alone (``kernels/attention.cpp``), so that a row's result never depends on the rows or sequences
beside it, in one call per layer for all the sequences of a batched forward: the engine's CPU
attention (``RowKernelAttention``; a stage's ``exact_rows``). models/attention.py
``RowsAloneAttention`` does the same with one SDPA call per row where the kernel does not build.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def rows_kernel(isa: str | None = None) -> Callable | None:
    """``rows_attention(q [1, H, R, D], keys, values, bounds, scale) -> [1, R, H * D]`` compiled
    for this CPU (``kernels/attention.cpp``: float32, each row alone), or None where it cannot be
    built. One call covers a batch's sequences, and costs less than one SDPA call per sequence, or
    per row where rows must be exact (docs/notebook.md, "Measurements behind the code's choices").
    ``isa``: a build other than the widest."""
    from pipespec_mpi.models.cpu.flat_linear import build, kernel_source

    ext = build("pipespec_rows_attention_v1", kernel_source("attention.cpp"), ["rows_attention"], isa)
    return None if ext is None else ext.rows_attention


class RowKernelAttention:
    """The engine's CPU attention (models/engine.py ``Attention``): ``rows_kernel`` over a ragged
    batch, every row alone, all sequences in one call per layer; float32."""

    layout = "ragged"
    exact = True

    def __init__(self, kernel: Callable) -> None:
        self.kernel = kernel

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b, scale: float) -> torch.Tensor:
        r, heads, d = q.shape
        ks = [k[s : s + 1, :, : start + n] for s, start, n in b.seqs]  # [1, kv_heads, L, D] views
        vs = [v[s : s + 1, :, : start + n] for s, start, n in b.seqs]
        return self.kernel(q.view(1, r, heads, d).transpose(1, 2), ks, vs, list(b.bounds), scale).view(r, -1)

    def __repr__(self) -> str:
        return "row kernel"
