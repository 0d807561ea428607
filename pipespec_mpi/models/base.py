"""``KVScorer``: a transformers causal LM as a stage's ``Scorer`` (the protocols of what a stage
computes with, ``Scorer`` and ``Proposer``, are in stage/ports.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from pipespec_mpi.models.kv_cache import preallocated_cache

log = logging.getLogger("pipespec_mpi")


class KVScorer:
    """A transformers causal LM plus a KV cache rolled back with ``crop``.

    The cache is preallocated for prompt + ``room`` positions (``models/kv_cache.py``): appending
    copies only the new tokens and rolling back moves an index. Llama-family models run the lean
    forward of ``models/lean.py`` (bitwise the transformers forward, without its framework
    overhead) unless ``lean`` is False; build the scorer once the model's modules are final
    (linears swapped, attention implementation set).
    """

    def __init__(self, name: str, model: torch.nn.Module, device: torch.device, lean: bool = True) -> None:
        self.name = name
        self.model = model.eval()
        self.device = device
        self._cache = preallocated_cache(model.config, 1)
        self._len = 0
        self._lean = None
        why = "transformers forward (lean=False)"
        if lean:
            from pipespec_mpi.models.lean import build_lean

            self._lean, why = build_lean(self.model)
        log.info("%s: %s", name, why)

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
        if self._lean is not None:
            logits = self._lean.forward(ids, self._cache, keep)
        else:
            logits = self.model(input_ids=ids, cache=self._cache, use_cache=True, logits_to_keep=keep).logits
        self._len += len(tokens)
        return logits[0]  # [keep, V]

    def logits(self, seq: Sequence[int], proposal: Sequence[int]) -> torch.Tensor:
        if self._len >= len(seq):
            raise RuntimeError(f"{self.name}: cache holds {self._len} >= {len(seq)} positions")
        new = list(seq[self._len :]) + list(proposal)
        return self._forward(new, keep=len(proposal) + 1).float()

    def truncate(self, length: int) -> None:
        if self._len > length:
            self._cache.crop(length - self._len)  # transformers 5: negative = tokens to remove
            self._len = length
