"""Grouped-query attention without copying the KV cache.

transformers' ``sdpa`` attention hands torch grouped-query heads natively (``enable_gqa``) only
when there is no mask; a verification forward over k > 1 tokens after a cache has a mask, so it
copies every layer's keys and values ``num_key_value_groups`` times (``repeat_kv``): O(context)
per layer and forward, about 3-4 ms of a SmolLM2 verification at 200 tokens of context. torch's
SDPA broadcasts the groups itself with a mask as well, with the same result (checked bitwise in
tests/unit/test_kv_cache.py), so this registers ``sdpa_gqa``: transformers' sdpa with
``enable_gqa`` always on. Masks are built exactly as for ``sdpa``.
"""

from __future__ import annotations

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
