"""Random-weight models of the Llama shapes of the paper's models (and SmolLM2-135M's).

A forward's cost does not depend on the weights' values, so a model of a real model's shape with
seeded random weights measures its costs with no weight files and no network: the simulator's
profile (simulate/profile.py) and the ``random`` stage kind (conf/hierarchy/random_*.yaml, what
bench/gpu_check.sh runs on a bare GPU machine). The shapes themselves: config/shapes.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipespec_mpi.config.shapes import SHAPES, params

if TYPE_CHECKING:
    import torch

__all__ = ["SHAPES", "params", "random_llama"]


def random_llama(shape: str, device: str | torch.device, dtype: torch.dtype, seed: int = 0):
    """A ``LlamaForCausalLM`` of ``shape`` in inference mode, its weights transformers' random
    initialisation from ``seed``, drawn on ``device`` in ``dtype`` (no float32 copy of an 8B
    first): the same weights on every rank that asks for the same seed on the same kind of device."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}: choose from {', '.join(SHAPES)}")
    config = LlamaConfig(**SHAPES[shape], rope_theta=500000.0, max_position_embeddings=8192)
    before = torch.get_default_dtype()
    torch.manual_seed(seed)  # every device's generator
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    return model.to(dtype).eval()
