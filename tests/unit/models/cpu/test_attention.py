"""The row attention kernel (kernels/attention.cpp, ``models/attention.rows_kernel``): SDPA's
causal attention to float32 rounding, and every row bitwise the same whatever rows and
sequences share its call, in every build this CPU runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipespec_mpi.host.dispatch import supported_isas
from pipespec_mpi.models.cpu.attention import rows_kernel

ISAS = [
    pytest.param(isa, marks=pytest.mark.skipif(rows_kernel(isa) is None, reason="no build"))
    for isa in supported_isas()
]
if not ISAS:
    ISAS = [pytest.param(None, marks=pytest.mark.skip(reason="no vector ISA for the kernels"))]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference: rows are the last positions of the cache, causal; [1, R, H * D]."""
    n, length = q.shape[2], k.shape[2]
    mask = torch.arange(length)[None, :] <= (torch.arange(n) + length - n)[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(1, n, -1)


def _case(g: torch.Generator, heads: int, kv_heads: int, d: int, length: int, n: int, cap: int = 0):
    """q [1, H, n, D]; keys and values as cache views: the first ``length`` of ``cap`` positions."""
    cap = max(cap, length)
    k = torch.randn(1, kv_heads, cap, d, generator=g)[:, :, :length]
    v = torch.randn(1, kv_heads, cap, d, generator=g)[:, :, :length]
    q = torch.randn(1, heads, n, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 4, 16), (6, 2, 18), (2, 1, 8)])
def test_equals_sdpa_and_each_row_alone(isa, heads, kv_heads, d):
    fn = rows_kernel(isa)
    g = torch.Generator().manual_seed(heads * 100 + d)
    for length, n in ((1, 1), (5, 5), (17, 3), (33, 1), (300, 8), (47, 16)):
        q, k, v = _case(g, heads, kv_heads, d, length, n, cap=length + 7)
        got = fn(q, [k], [v], [0, n], 0.125)
        assert got.shape == (1, n, heads * d)
        torch.testing.assert_close(got, _sdpa(q, k, v, 0.125), atol=2e-6, rtol=1e-5)
        for i in range(n):  # the row alone: its query, the keys up to its position
            end = length - n + i + 1
            alone = fn(q[:, :, i : i + 1].contiguous(), [k[:, :, :end]], [v[:, :, :end]], [0, 1], 0.125)
            assert torch.equal(alone[0, 0], got[0, i]), (length, n, i)


@pytest.mark.parametrize("isa", ISAS)
def test_sequences_in_one_call_equal_each_alone(isa):
    fn = rows_kernel(isa)
    g = torch.Generator().manual_seed(3)
    cases = [_case(g, 9, 3, 64, length, n, cap=400) for length, n in ((300, 1), (17, 5), (250, 3), (1, 1))]
    bounds = [0]
    for q, _, _ in cases:
        bounds.append(bounds[-1] + q.shape[2])
    q_all = torch.cat([c[0] for c in cases], dim=2)
    got = fn(q_all, [c[1] for c in cases], [c[2] for c in cases], bounds, 0.125)
    for b, (q, k, v) in enumerate(cases):
        alone = fn(q, [k], [v], [0, q.shape[2]], 0.125)
        assert torch.equal(alone[0], got[0, bounds[b] : bounds[b + 1]]), b


@pytest.mark.parametrize("isa", ISAS)
def test_far_scores_weigh_nothing_and_stay_finite(isa):
    """exp underflows to 0 below -87 as float32 does; one key far above the rest takes the row."""
    fn = rows_kernel(isa)
    k = torch.zeros(1, 1, 40, 16)
    v = torch.arange(40, dtype=torch.float32).view(1, 1, 40, 1).expand(1, 1, 40, 16).contiguous()
    k[0, 0, 21] = 10.0
    q = torch.ones(1, 1, 1, 16)
    got = fn(q, [k], [v], [0, 1], 1.0)  # scores 160 at key 21, 0 elsewhere
    assert torch.isfinite(got).all()
    assert torch.equal(got, torch.full((1, 1, 16), 21.0))


@pytest.mark.parametrize("isa", ISAS)
def test_rejects_what_it_cannot_compute(isa):
    fn = rows_kernel(isa)
    q, k, v = _case(torch.Generator().manual_seed(0), 4, 2, 16, 10, 2)
    with pytest.raises(RuntimeError, match="bounds"):
        fn(q, [k], [v], [0, 3], 0.125)  # rows do not add up
    with pytest.raises(RuntimeError, match="new rows"):
        fn(q[:, :, :2], [k[:, :, :1]], [v[:, :, :1]], [0, 2], 0.125)  # more new rows than positions
    with pytest.raises(RuntimeError, match="float32"):
        fn(q.double(), [k], [v], [0, 2], 0.125)
    with pytest.raises(RuntimeError, match="multiple"):
        fn(torch.randn(1, 3, 2, 16), [k], [v], [0, 2], 0.125)  # 3 query heads over 2 key heads
