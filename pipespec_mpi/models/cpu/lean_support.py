"""Which models the lean forward (lean.py) can run: unsupported_reason checks a transformers
model's class, attention and mask functions, rotary scaling and modules, and names what differs.
And the element-wise ops it runs in place of transformers' modules, each exact."""

from __future__ import annotations

import torch


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run the lean forward, or None when it can."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama as ml

    from pipespec_mpi.models.cpu.attention import NAME as SDPA_GQA
    from pipespec_mpi.models.cpu.attention import sdpa_gqa_forward

    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in ("llama",):
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not llama"
    if type(model) is not ml.LlamaForCausalLM or type(model.model) is not ml.LlamaModel:
        return f"{type(model).__name__} is not transformers' LlamaForCausalLM"
    if model.training:
        return "model is in training mode"
    if not getattr(cfg, "is_causal", True):
        return "config.is_causal is False (bidirectional attention)"
    impl = getattr(cfg, "_attn_implementation", None)
    expected = {"sdpa": sdpa_attention_forward, SDPA_GQA: sdpa_gqa_forward}
    if impl not in expected:
        return f"attention implementation {impl!r} (lean reproduces sdpa and sdpa_gqa)"
    if ALL_ATTENTION_FUNCTIONS.get(impl) is not expected[impl]:
        return f"attention {impl!r} is registered to another function"
    if ALL_MASK_ATTENTION_FUNCTIONS.get(impl) is not sdpa_mask:
        return f"mask function of {impl!r} is not sdpa_mask"
    attn0 = model.model.layers[0].self_attn if len(model.model.layers) else None
    if impl == "sdpa" and attn0 is not None and attn0.head_dim > 256:
        return "sdpa with head_dim > 256 (transformers packs GQA queries there)"
    rope = getattr(model.model, "rotary_emb", None)
    if type(rope) is not ml.LlamaRotaryEmbedding:
        return f"rotary embedding {type(rope).__name__} is not LlamaRotaryEmbedding"
    if not isinstance(rope.rope_type, str) or "dynamic" in rope.rope_type or rope.rope_type == "longrope":
        return f"rope type {rope.rope_type!r} rescales with the sequence length"
    embed = model.model.embed_tokens
    if type(embed) is not torch.nn.Embedding or embed.max_norm is not None:
        return f"embedding {type(embed).__name__} is not a plain nn.Embedding"
    device = embed.weight.device
    if device.type != "cpu":
        return f"device {device} (the lean forward is verified on CPU only)"
    n = cfg.num_hidden_layers
    if len(model.model.layers) < n:
        return f"{len(model.model.layers)} layers for num_hidden_layers={n}"
    for i, layer in enumerate(model.model.layers[:n]):
        if type(layer) is not ml.LlamaDecoderLayer:
            return f"layer {i} is {type(layer).__name__}"
        if type(layer.self_attn) is not ml.LlamaAttention or type(layer.mlp) is not ml.LlamaMLP:
            return f"layer {i}: attention/MLP classes are not Llama's"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(m) is not ml.LlamaRMSNorm for m in norms):
            return f"layer {i}: norm is not LlamaRMSNorm"
    if type(model.model.norm) is not ml.LlamaRMSNorm:
        return "final norm is not LlamaRMSNorm"
    for name, mod in model.named_modules():
        if mod._forward_hooks or mod._forward_pre_hooks or hasattr(mod, "_hf_hook"):
            return f"module {name or type(mod).__name__} has forward hooks"
        if "forward" in vars(mod):
            return f"module {name} has its forward replaced on the instance"
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return "global module forward hooks are installed"
    return None


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward, op for op (in place where the value is a fresh temporary)."""
    input_dtype = h.dtype
    if input_dtype is not torch.float32:
        h = h.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * variance.add_(eps).rsqrt_()
    if input_dtype is not torch.float32:
        h = h.to(input_dtype)
    if weight.dtype is input_dtype:
        return h.mul_(weight)  # weight * h: the same products
    return weight * h


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin_s: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """apply_rotary_pos_emb's ``x * cos + rotate_half(x) * sin`` in 4 ops instead of 7:
    rotate_half(x) * sin == roll(x, D/2) * sin_s, with sin_s = ``_signed(sin)``, product for
    product ((-a) * b == a * (-b) exactly); same values, and the same strides for the result."""
    return torch.add(x * cos, torch.roll(x, x.shape[-1] // 2, -1) * sin_s, out=out)


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with the first half of its last dim negated (exact: a sign flip)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
