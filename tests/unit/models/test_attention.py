"""The portable attention back-ends (models/attention.py) in float64: the grid's packed query
heads against the unpacked grid (``enable_gqa``) and each row against SDPA over its own positions
with the key/value heads repeated (every group size, padding rows, a span shorter than the cache),
within a few ulp: SDPA's GEMMs change their row count with the packing, and BLAS may round the
last bit differently (measured up to 3.3e-16). SDPA one row at a time is that reference bitwise."""

from __future__ import annotations

import pytest
import torch

from pipespec_mpi.models.attention import GridAttention, RowsAloneAttention
from pipespec_mpi.models.rows import Batch

ULPS = 1e-14  # a few float64 ulp at these magnitudes; a wrong head order is off by ~1e-1


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, scale: float) -> torch.Tensor:
    """One row [heads, D] over positions 0..pos of one slot's k, v [kv_heads, C, D]: SDPA with the
    key/value heads repeated (transformers' ``repeat_kv``)."""
    group = q.shape[0] // k.shape[0]
    kr = k[None, :, : pos + 1].repeat_interleave(group, 1)
    vr = v[None, :, : pos + 1].repeat_interleave(group, 1)
    return torch.nn.functional.scaled_dot_product_attention(q[None, :, None], kr, vr, scale=scale).reshape(-1)


def unpacked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: Batch, scale: float) -> torch.Tensor:
    """The grid's attention without packing: SDPA over [S, heads, T, D] with ``enable_gqa``."""
    r, heads, d = q.shape
    s_n, t_n = r // b.width, b.width
    k, v = k[b.grid_slots, :, : b.span], v[b.grid_slots, :, : b.span]
    visible = torch.arange(b.span) <= b.pos.view(s_n, 1, t_n, 1)
    qg = q.view(s_n, t_n, heads, d).transpose(1, 2)
    att = torch.nn.functional.scaled_dot_product_attention(
        qg, k, v, attn_mask=visible, scale=scale, enable_gqa=heads != k.shape[1]
    )
    return att.transpose(1, 2).reshape(r, heads * d)


def case(heads: int, kv_heads: int, lengths: list[int], starts: list[int], cap: int = 40, d: int = 8):
    g = torch.Generator().manual_seed(heads * 100 + kv_heads)
    k = torch.randn(len(lengths), kv_heads, cap, d, generator=g, dtype=torch.float64)
    v = torch.randn(len(lengths), kv_heads, cap, d, generator=g, dtype=torch.float64)
    q = {(s, j): torch.randn(heads, d, generator=g, dtype=torch.float64) for s, n in enumerate(lengths)
         for j in range(n)}  # fmt: skip
    return q, k, v


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2), (9, 3)])
@pytest.mark.parametrize("span", [39, 16])
def test_packed_grid_attention_is_the_reference(heads, kv_heads, span):
    lengths, starts, cap = [3, 1, 5], [4, 10, 0], 40
    q, k, v = case(heads, kv_heads, lengths, starts, cap)
    width = max(lengths)
    rows = [(s, j) for s in range(len(lengths)) for j in range(width)]
    real = [j < lengths[s] for s, j in rows]
    zero = torch.zeros(heads, 8, dtype=torch.float64)
    qt = torch.stack([q[(s, j)] if ok else zero for (s, j), ok in zip(rows, real, strict=True)])
    pos = [starts[s] + j if ok else 0 for (s, j), ok in zip(rows, real, strict=True)]
    b = Batch.of(torch.device("cpu"), tokens=[0] * len(rows), pos=pos, slot=[s for s, _ in rows],
                 write=pos, keep=[], grid_slots=slice(0, 3), width=width, span=span)  # fmt: skip
    got = GridAttention()(qt, k, v, b, 0.3)
    assert torch.allclose(got, unpacked(qt, k, v, b, 0.3), rtol=0, atol=ULPS)
    for i, ((s, j), ok) in enumerate(zip(rows, real, strict=True)):
        if ok:
            assert torch.allclose(got[i], reference(q[(s, j)], k[s], v[s], pos[i], 0.3), rtol=0, atol=ULPS)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (9, 3)])
def test_rows_alone_attention_is_the_reference_bitwise(heads, kv_heads):
    lengths, starts = [3, 1, 5], [4, 10, 0]
    q, k, v = case(heads, kv_heads, lengths, starts)
    order = [(s, j) for s, n in enumerate(lengths) for j in range(n)]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    pos = [starts[s] + j for s, j in order]
    b = Batch.of(torch.device("cpu"), tokens=[0] * len(order), pos=pos, slot=[s for s, _ in order],
                 write=pos, keep=[], seqs=tuple(zip(range(3), starts, lengths, strict=True)),
                 bounds=tuple(bounds))  # fmt: skip
    got = RowsAloneAttention(heads != kv_heads)(torch.stack([q[r] for r in order]), k, v, b, 0.3)
    for i, (s, j) in enumerate(order):
        assert torch.equal(got[i], reference(q[(s, j)], k[s], v[s], pos[i], 0.3)), (s, j)


def test_the_comparison_can_fail():
    """Packing a group's heads in the wrong order (h = j * kv_heads + g) is caught."""
    q, k, v = case(4, 2, [2], [3])
    qt = torch.stack([q[(0, 0)], q[(0, 1)]])
    swapped = qt.view(2, 2, 2, 8).transpose(1, 2).reshape(2, 4, 8)
    b = Batch.of(torch.device("cpu"), tokens=[0, 0], pos=[3, 4], slot=[0, 0], write=[3, 4], keep=[],
                 grid_slots=slice(0, 1), width=2, span=39)  # fmt: skip
    got = GridAttention()(swapped, k, v, b, 0.3).view(2, 2, 2, 8).transpose(1, 2).reshape(2, -1)
    assert not torch.allclose(got, unpacked(qt, k, v, b, 0.3), rtol=0, atol=ULPS)
