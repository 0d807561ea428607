"""A stage's decoder layers split over its GPUs, for a model too large for one (the paper's 70B
over two 40 GB GPUs): contiguous runs of layers, the embedding on the first GPU, the final norm
and the LM head on the last. The engine (models/engine.py ``forward``) moves the rows on at each
boundary; the weights and the KV cache never move."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def layer_devices(n_layers: int, devices: Sequence[torch.device]) -> list[torch.device]:
    """Each of ``n_layers`` decoder layers' device: contiguous runs, as even as they divide."""
    return [devices[i * len(devices) // n_layers] for i in range(n_layers)]


def spread(model: torch.nn.Module, devices: Sequence[torch.device]) -> torch.nn.Module:
    """``model`` (a Llama causal LM) with its decoder layers split over ``devices``
    (``layer_devices``), the embedding and rotary tables on the first, the final norm and the LM
    head on the last (a head tied to the embedding gets a copy of its own there); one device:
    all of it there."""
    inner = model.model
    if len(devices) == 1:
        return model.to(devices[0])
    first, last = devices[0], devices[-1]
    head = model.lm_head
    if head.weight is inner.embed_tokens.weight:
        head.weight = torch.nn.Parameter(head.weight.detach().to(last, copy=True), requires_grad=False)
    inner.embed_tokens.to(first)
    inner.rotary_emb.to(first)
    for lay, d in zip(inner.layers, layer_devices(len(inner.layers), devices), strict=True):
        lay.to(d)
    inner.norm.to(last)
    head.to(last)
    return model
