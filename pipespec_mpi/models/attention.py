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
    its own within the first ``b.span`` (padding rows see position 0 only; their results are never
    read). Grouped-query heads go packed: a group's query heads along the query axis against its
    one key/value head, so K and V are never repeated and no kernel is ruled out by ``enable_gqa``
    (bitwise the unpacked attention in float64: tests/unit/models/test_attention.py)."""

    layout = "grid"
    exact = False

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: Batch, scale: float
    ) -> torch.Tensor:
        r, heads, d = q.shape
        s_n, t_n, kv_heads = r // b.width, b.width, k.shape[1]
        group = heads // kv_heads
        k, v = k[b.grid_slots, :, : b.span], v[b.grid_slots, :, : b.span]  # [S, kv_heads, L, D] views
        visible = torch.arange(b.span, device=q.device) <= b.pos.view(s_n, 1, t_n, 1)  # [S, 1, T, L]
        # query head h = g * group + j (transformers' repeat_kv) -> packed row j * T + t of group g
        qg = (
            q.view(s_n, t_n, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(s_n, kv_heads, group * t_n, d)
        )
        mask = visible.repeat(1, 1, group, 1) if group > 1 else visible
        att = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [S, kv_heads, G T, D]
        return att.view(s_n, kv_heads, group, t_n, d).permute(0, 3, 1, 2, 4).reshape(r, heads * d)

    def __repr__(self) -> str:
        return "SDPA over the slots' grid, query heads packed per group"


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
