"""The engine's portable attention back-ends (models/engine.py ``Attention``); the CPU's row kernel
is models/cpu/attention.py ``RowKernelAttention``.

``GridAttention``: one SDPA call over the slots' padded grid with a mask (any device, compiles).
``RowsAloneAttention``: one SDPA call per row over its slot's cache up to itself, the call a
one-token forward makes, so that a row's result never depends on the rows beside it (SDPA rounds
a row differently with other rows beside it, which could tip a near-tie of a verification away
from what one-token steps commit); where the row kernel does not build.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipespec_mpi.models.rows import Batch


class GridAttention:
    """SDPA over ``b.grid_slots`` x ``b.width`` rows, each row seeing its slot's positions up to
    its own (padding rows see position 0 only; their results are never read)."""

    layout = "grid"
    exact = False

    def __init__(self, gqa: bool) -> None:
        self.gqa = gqa

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: Batch, scale: float
    ) -> torch.Tensor:
        r, heads, d = q.shape
        s_n, t_n = r // b.width, b.width
        k, v = k[b.grid_slots], v[b.grid_slots]  # [S, kv_heads, C, D] views
        cap = k.shape[2]
        visible = torch.arange(cap, device=q.device) <= b.pos.view(s_n, 1, t_n, 1)  # [S, 1, T, C]
        qg = q.view(s_n, t_n, heads, d).transpose(1, 2)
        att = F.scaled_dot_product_attention(qg, k, v, attn_mask=visible, scale=scale, enable_gqa=self.gqa)
        return att.transpose(1, 2).reshape(r, heads * d)

    def __repr__(self) -> str:
        return "SDPA over the slots' grid"


class RowsAloneAttention:
    """One SDPA call per row of a ragged batch, as that row's one-token forward makes it."""

    layout = "ragged"
    exact = True

    def __init__(self, gqa: bool) -> None:
        self.gqa = gqa

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: Batch, scale: float
    ) -> torch.Tensor:
        r, heads, d = q.shape
        rows = []
        for (slot, start, n), lo in zip(b.seqs, b.bounds, strict=False):
            ks, vs = k[slot : slot + 1], v[slot : slot + 1]
            for j in range(n):
                qi = q[lo + j].view(1, heads, 1, d)
                end = start + j + 1
                rows.append(
                    F.scaled_dot_product_attention(
                        qi, ks[:, :, :end], vs[:, :, :end], scale=scale, enable_gqa=self.gqa
                    ).view(1, heads * d)
                )
        return torch.cat(rows)

    def __repr__(self) -> str:
        return "SDPA one row at a time"
