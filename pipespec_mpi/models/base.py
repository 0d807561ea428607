"""The two things a stage can compute with.

``Scorer``: a causal LM with a KV cache that can be cut back to any length. It returns the
logits for the positions after a committed sequence plus an optional proposal, in one forward.
``Proposer``: a model-free drafter (prompt lookup) that proposes tokens from the text so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pipespec_mpi.models.kv_cache import preallocated_cache


class Scorer(Protocol):
    name: str

    def prefill(self, prompt: Sequence[int], room: int = 0) -> None:
        """Start a new sequence: reset the cache and encode all but the last prompt token.

        ``room``: how many positions the sequence may grow beyond the prompt (sizes the cache).
        """

    def logits(self, seq: Sequence[int], proposal: Sequence[int]) -> torch.Tensor:
        """Logits [len(proposal)+1, V] for the positions after ``seq`` and each proposal prefix.

        ``seq`` is the full sequence (prompt + committed tokens); tokens not yet in the cache are
        encoded in the same forward. Afterwards the cache holds seq + proposal.
        """

    def truncate(self, length: int) -> None:
        """Cut the cache back to its first ``length`` positions (no-op if it is shorter)."""

    @property
    def cached(self) -> int: ...


class Proposer(Protocol):
    name: str

    def prefill(self, prompt: Sequence[int], room: int = 0) -> None: ...

    def propose(self, seq: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` draft tokens continuing ``seq`` (may be empty)."""


class KVScorer:
    """A transformers causal LM plus a KV cache rolled back with ``crop``.

    The cache is preallocated for prompt + ``room`` positions (``models/kv_cache.py``): appending
    copies only the new tokens and rolling back moves an index.
    """

    def __init__(self, name: str, model: torch.nn.Module, device: torch.device) -> None:
        self.name = name
        self.model = model.eval()
        self.device = device
        self._cache = preallocated_cache(model.config, 1)
        self._len = 0
        self._ids = torch.empty(0, dtype=torch.long)

    @property
    def cached(self) -> int:
        return self._len

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_context(self) -> int | None:
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if n else None

    def prefill(self, prompt: Sequence[int], room: int = 0) -> None:
        self._cache = preallocated_cache(self.model.config, len(prompt) + room)
        self._len = 0
        if len(prompt) > 1:
            self._forward(list(prompt[:-1]), keep=1)

    @torch.inference_mode()
    def _forward(self, tokens: list[int], keep: int) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)  # [1, T]
        out = self.model(input_ids=ids, cache=self._cache, use_cache=True, logits_to_keep=keep)
        self._len += len(tokens)
        return out.logits[0]  # [keep, V]

    def logits(self, seq: Sequence[int], proposal: Sequence[int]) -> torch.Tensor:
        if self._len >= len(seq):
            raise RuntimeError(f"{self.name}: cache holds {self._len} >= {len(seq)} positions")
        new = list(seq[self._len :]) + list(proposal)
        return self._forward(new, keep=len(proposal) + 1).float()

    def truncate(self, length: int) -> None:
        if self._len > length:
            self._cache.crop(length - self._len)  # transformers 5: negative = tokens to remove
            self._len = length
