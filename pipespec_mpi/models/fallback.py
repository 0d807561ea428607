"""``TransformersScorer``: transformers' own forward as a stage's ``Scorer``, the named fallback for
architectures the engine (models/engine.py) does not know. What such a stage loses is logged at
load: its slots are not batched (one forward each), it is not compiled and has no exact rows.

The KV cache is preallocated (models/kv_cache.py): appending copies only the new tokens and a
rollback moves an index. On a CPU, grouped-query models attend through ``sdpa_gqa``
(transformers' sdpa with torch's own GQA broadcast instead of a copy of the cache per layer).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from pipespec_mpi.models.kv_cache import preallocated_cache

LOSES = "no batched slots, no compile, no exact rows"


class TransformersScorer:
    """A transformers causal LM plus a KV cache rolled back with ``crop``."""

    batchable = False
    thread_invariant = False

    def __init__(self, name: str, model: torch.nn.Module, device: torch.device) -> None:
        self.name = name
        self.model = model.eval()
        self.device = device
        self._cache = preallocated_cache(model.config, 1)
        self._cache_kwarg = cache_kwarg(model)
        self.length = 0

    @property
    def backend(self) -> TransformersScorer:
        return self

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_context(self) -> int | None:
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if n else None

    def describe(self) -> str:
        return f"transformers forward on {self.device} ({LOSES})"

    def prefill(self, prompt: Sequence[int], room: int = 0) -> None:
        self._cache = preallocated_cache(self.model.config, len(prompt) + room)
        self.length = 0
        if len(prompt) > 1:
            self._forward(list(prompt[:-1]), keep=1)

    @torch.inference_mode()
    def _forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, T]
        kwargs = {self._cache_kwarg: self._cache}
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=keep, **kwargs)
        self.length += len(tokens)
        return out.logits[0]  # [keep, V]

    def logits(self, seq: Sequence[int], proposal: Sequence[int]) -> torch.Tensor:
        if self.length >= len(seq):
            raise RuntimeError(f"{self.name}: cache holds {self.length} >= {len(seq)} positions")
        return self._forward([*seq[self.length :], *proposal], keep=len(proposal) + 1).float()

    def score_many(
        self, requests: Sequence[tuple[TransformersScorer, Sequence[int], Sequence[int]]]
    ) -> list[torch.Tensor]:
        """One forward per request (the fallback has no batched forward)."""
        return [sc.logits(seq, proposal) for sc, seq, proposal in requests]

    def truncate(self, length: int) -> None:
        if self.length > length:
            self._cache.crop(length - self.length)  # transformers 5: negative = tokens to remove
            self.length = length

    def for_slot(self) -> TransformersScorer:
        """Another sequence on the same model, with its own KV cache."""
        other = copy.copy(self)
        other._cache = preallocated_cache(self.model.config, 1)
        other.length = 0
        return other


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name transformers' forward takes the KV cache by: ``cache`` in the transformers CI pins,
    ``past_key_values`` in 5.17 (what a GPU site may bring), where an unknown ``cache=`` would be
    swallowed by ``**kwargs`` and every forward would start again from position 0."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


SDPA_GQA = "sdpa_gqa"


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
    AttentionInterface.register(SDPA_GQA, sdpa_gqa_forward)
    AttentionMaskInterface.register(SDPA_GQA, sdpa_mask)
    model.set_attn_implementation(SDPA_GQA)
    return True
