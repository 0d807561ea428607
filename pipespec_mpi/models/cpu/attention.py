"""Grouped-query attention without copying the KV cache.

transformers' ``sdpa`` attention hands torch grouped-query heads natively (``enable_gqa``) only
when there is no mask; a verification forward over k > 1 tokens after a cache has a mask, so it
copies every layer's keys and values ``num_key_value_groups`` times (``repeat_kv``): O(context)
per layer and forward (docs/notebook.md, "Measurements behind the code's choices"). torch's
SDPA broadcasts the groups itself with a mask as well, with the same result (checked bitwise in
tests/unit/models/test_kv_cache.py), so this registers ``sdpa_gqa``: transformers' sdpa with
``enable_gqa`` always on. Masks are built exactly as for ``sdpa``.

``rows_kernel``: causal attention of new rows over each sequence's cache with every row computed
alone (``kernels/attention.cpp``), so that a row's result never depends on the rows or sequences
beside it, in one call per layer for all the sequences of a batched forward; the lean forward's
``rows_alone`` (a stage's ``exact_rows``). ``attend_rows_alone`` does the same with one SDPA call
per row where the kernel does not build.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_gqa"


def sdpa_gqa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H_q, q, D]
    key: torch.Tensor,  # [B, H_kv, kv, D]
    value: torch.Tensor,  # [B, H_kv, kv, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    groups = getattr(module, "num_key_value_groups", 1)
    special = kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
    if groups == 1 or special or kwargs.get("output_attentions", False):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask,
            dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs,
        )  # fmt: skip
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # as in transformers: the flag only without a mask and beyond one query; top-left alignment
    causal = q_len > 1 and attention_mask is None and causal
    if causal and key.shape[2] > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=True,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None  # [B, q, H_q, D]


def use_sdpa_gqa(model: torch.nn.Module) -> bool:
    """Switch ``model`` from ``sdpa`` to ``sdpa_gqa``; False (unchanged) if it uses something else."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(NAME, sdpa_gqa_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True


def rows_kernel(isa: str | None = None) -> Callable | None:
    """``rows_attention(q [1, H, R, D], keys, values, bounds, scale) -> [1, R, H * D]`` compiled
    for this CPU (``kernels/attention.cpp``: float32, each row alone), or None where it cannot be
    built. One call covers a batch's sequences, and costs less than one SDPA call per sequence, or
    per row where rows must be exact (docs/notebook.md, "Measurements behind the code's choices").
    ``isa``: a build other than the widest."""
    from pipespec_mpi.models.cpu.flat_linear import build, kernel_source

    ext = build("pipespec_rows_attention_v1", kernel_source("attention.cpp"), ["rows_attention"], isa)
    return None if ext is None else ext.rows_attention


def attend_rows_alone(
    sdpa: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kw: dict
) -> torch.Tensor:
    """Causal attention of the last T positions [1, H, T, D] over keys and values [1, H_kv, L, D]
    (L >= T, the new positions last), each row as the one-query call a forward of that token alone
    makes: no mask, the keys up to its own position. SDPA's kernels round a row differently with
    other rows beside it (1e-7 on the tiny test models), which could tip a near-tie between two
    logits of a verification away from what one-token steps (AR) commit; one call per row cannot.
    Its cost is a small share of a forward (docs/notebook.md, "Measurements behind the code's
    choices")."""
    t, past = q.shape[2], k.shape[2] - q.shape[2]
    rows = [
        sdpa(q[:, :, i : i + 1], k[:, :, : past + i + 1], v[:, :, : past + i + 1], attn_mask=None,
             dropout_p=0.0, scale=scale, is_causal=False, **kw)
        for i in range(t)
    ]  # fmt: skip
    return torch.cat(rows, dim=2)
