"""The fallback scorer (models/fallback.py) hands transformers' forward its KV cache by the name
that transformers version takes: ``cache`` in CI's pin, ``past_key_values`` in 5.17 (a GPU site's),
where ``cache=`` would vanish into ``**kwargs`` and each forward start again at position 0."""

from __future__ import annotations

import torch

from pipespec_mpi.models.fallback import cache_kwarg


class Older(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, use_cache=None, logits_to_keep=0, **kwargs):
        return None


class Newer(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=None, logits_to_keep=0, **kwargs):
        return None


def test_the_cache_goes_by_the_name_the_forward_takes():
    assert cache_kwarg(Older()) == "past_key_values"
    assert cache_kwarg(Newer()) == "cache"
