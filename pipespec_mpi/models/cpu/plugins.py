"""The CPU kernels as the engine's plug-ins (models/engine.py): which attention and activation a
CPU stage runs, and whether its logits are the same on any number of threads."""

from __future__ import annotations

import torch

from pipespec_mpi.models.attention import GridAttention, RowsAloneAttention
from pipespec_mpi.models.cpu.attention import RowKernelAttention, rows_kernel
from pipespec_mpi.models.cpu.flat_linear import FlatLinear
from pipespec_mpi.models.cpu.lowbit import LowBitLinear
from pipespec_mpi.models.engine import Weights, silu_by_rows
from pipespec_mpi.models.rows import Attention


def cpu_weights(model: torch.nn.Module, exact_rows: bool | None) -> Weights:
    """The engine's weights of a CPU ``model`` (its linears already swapped for the kernels'):
    with ``exact_rows`` every row's attention alone, by the row kernel where it builds (float32),
    else one SDPA call per row; None: exact where the row kernel runs. Rows alone buy nothing
    where the linears round rows differently anyway (torch's GEMM), so without the row kernel and
    without a row-exact linear the grid's SDPA runs."""
    weights = Weights.of(model, act=silu_by_rows)
    a = weights.arch
    kernel = rows_kernel() if weights.dtype == torch.float32 else None
    if exact_rows is None:
        exact_rows = kernel is not None
    attention: Attention = GridAttention()
    if exact_rows and kernel is not None:
        attention = RowKernelAttention(kernel)
    elif exact_rows and weights.max_rows is not None:
        attention = RowsAloneAttention(a.gqa)
    weights.attention = attention
    return weights


def on_kernels(m: object) -> bool:
    """A linear whose output is bitwise the same on any number of threads (the CPU kernels)."""
    if isinstance(m, FlatLinear):
        return m.tiled
    if isinstance(m, LowBitLinear):
        return m._fn is not None and not m.dense
    parts = getattr(m, "parts", None)  # engine.Concat
    return parts is not None and all(on_kernels(p) for p in parts)


def thread_invariant(w: Weights) -> bool:
    """The engine's logits are bitwise the same on any number of threads: the row kernel's
    attention, the activation by rows and every linear on the kernels
    (tests/unit/models/cpu/test_kernel_threads.py)."""
    return (
        isinstance(w.attention, RowKernelAttention)
        and w.act is silu_by_rows
        and all(on_kernels(m) for m in w.linears())
    )
