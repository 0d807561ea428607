"""A KV cache that appends by writing into preallocated buffers and rolls back by moving an index.

transformers' ``DynamicLayer`` appends with ``torch.cat``: every forward copies the layer's whole
cache, O(context) per step and per layer (docs/notebook.md, "Measurements behind the code's
choices"), and ``crop`` slices. Here each layer owns one buffer [batch, kv_heads, capacity,
head_dim]; ``update`` copies only the new tokens in and returns views of the filled prefix, and
``crop`` moves the length back. The capacity is what the sequence can
reach (prompt + max_new_tokens + the largest proposal), so a stage's cache is bounded by that; a
longer sequence grows the buffer by doubling (rare: one copy).

The attention sees exactly the keys and values ``DynamicLayer`` would give it (same values, a
strided view instead of a fresh tensor), so the model computes the same thing.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One attention layer's keys/values: buffers of ``capacity`` positions and a fill length."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = max(1, int(capacity))
        self.length = 0
        self._kbuf: torch.Tensor | None = None  # [B, H_kv, capacity, D]
        self._vbuf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._kbuf = key_states.new_empty(self._shape(key_states, self.capacity))
        self._vbuf = value_states.new_empty(self._shape(value_states, self.capacity))
        self.length = 0
        self.is_initialized = True

    @staticmethod
    def _shape(states: torch.Tensor, positions: int) -> tuple[int, ...]:
        b, h, _, d = states.shape
        return (b, h, positions, d)

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.capacity)
        for name in ("_kbuf", "_vbuf"):
            old = getattr(self, name)
            new = old.new_empty(self._shape(old, cap))
            new[:, :, : self.length].copy_(old[:, :, : self.length])
            setattr(self, name, new)
        self.capacity = cap

    def _views(self) -> None:
        self.keys = self._kbuf[:, :, : self.length]
        self.values = self._vbuf[:, :, : self.length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        end = self.length + new
        if end > self.capacity:
            self._grow(end)
        self._kbuf[:, :, self.length : end].copy_(key_states)
        self._vbuf[:, :, self.length : end].copy_(value_states)
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (transformers 5: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(0, self.length + tokens_to_remove)
        self._views()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._views()


def preallocated_cache(config, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are ``PreallocatedLayer``s.

    Layers of another kind (sliding windows, linear attention) keep transformers' own class.
    """
    cache = DynamicCache(config=config)
    if not cache.layers:  # no layer structure known from the config: build one per decoder layer
        n = config.get_text_config(decoder=True).num_hidden_layers
        cache.layers = [DynamicLayer() for _ in range(n)]
    cache.layers = [
        PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache
