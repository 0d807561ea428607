"""Llama shapes of the paper's models (and SmolLM2-135M's), as random-weight models.

A forward's cost does not depend on the weights' values, so a model of a real model's shape with
seeded random weights measures its costs with no weight files and no network: the simulator's
profile (simulate/profile.py) and the ``random`` stage kind (conf/hierarchy/random_*.yaml, what
bench/gpu_check.sh runs on a bare GPU machine). ``toy`` is a shape small enough for CI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SHAPES: dict[str, dict] = {
    "toy": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
    "135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256),
}  # fmt: skip


def params(shape: str) -> int:
    """Weights of a shape (what a memory-bound step reads)."""
    s = SHAPES[shape]
    h, i, n, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    d = h // s["num_attention_heads"]
    attn = h * d * (2 * s["num_attention_heads"] + 2 * s["num_key_value_heads"])
    return n * (attn + 3 * h * i) + v * h * (1 if s.get("tie_word_embeddings") else 2)


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
