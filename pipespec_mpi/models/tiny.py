"""The ``tiny`` hierarchy: random-initialised Llama models that agree often, but not always.

Independent random models almost never agree on an argmax, which would leave acceptance and
rollback untested. So every stage is derived from one seeded random target: it keeps the
target's first ``layers`` layers and perturbs all weights by Gaussian noise of relative size
``noise``. The target's later layers are damped (their residual branches scaled down), so that a
truncated copy stays close to it. Weights are built the same way on every rank, from the seed
alone, so no weights travel between ranks.
"""

from __future__ import annotations

import torch

from pipespec_mpi.config import TinyBaseConfig


def tiny_llama_config(base: TinyBaseConfig, layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=base.vocab_size,
        hidden_size=base.hidden_size,
        intermediate_size=base.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=base.num_heads,
        num_key_value_heads=base.num_kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )


def _target_state(base: TinyBaseConfig) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(base.seed)
    model = LlamaForCausalLM(tiny_llama_config(base, base.num_layers)).double()
    gen = torch.Generator().manual_seed(base.seed)
    state = {}
    for name, w in model.state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones_like(w)
            continue
        fan_in = w.shape[-1]
        state[name] = torch.randn(w.shape, generator=gen, dtype=torch.float64) * (
            base.init_std / fan_in**0.5 * (fan_in**0.5 if "embed" in name else 1.0)
        )
        # Damp the residual branches of later layers so truncated copies stay close.
        if ".layers." in name and name.endswith(("o_proj.weight", "down_proj.weight")):
            layer = int(name.split(".layers.")[1].split(".")[0])
            state[name] *= 0.5**layer
    return state


def build_tiny(base: TinyBaseConfig, layers: int | None, noise: float, seed: int, dtype: torch.dtype):
    """A stage model: the target's first ``layers`` layers, weights * (1 + noise * N(0, 1))."""
    from transformers import LlamaForCausalLM

    layers = layers or base.num_layers
    full = _target_state(base)
    model = LlamaForCausalLM(tiny_llama_config(base, layers)).double()
    keep = {
        k: v
        for k, v in full.items()
        if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < layers
    }
    if noise > 0:
        gen = torch.Generator().manual_seed(base.seed * 1000 + seed)
        keep = {
            k: v * (1 + noise * torch.randn(v.shape, generator=gen, dtype=v.dtype)) for k, v in keep.items()
        }
    model.load_state_dict(keep, strict=True)
    return model.to(dtype).eval()
