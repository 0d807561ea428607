"""The portable stage engine: a Llama-family decoder as small pure torch functions on any device.

One code path for CPU and CUDA (gpt-fast's shape): the weights as plain tensors read from any
Llama checkpoint transformers loads (``Weights.of``), in its dtype; a KV cache preallocated for S
slots of C positions (``KVCache``; rolling a slot back is moving its host-side length, nothing on
the device); and ``forward``, which runs B slots' new tokens, padded to T rows each, as one
forward: every row at its own position, attending its own slot's cache up to itself. Nothing in
``forward`` or ``greedy_accept`` reads a tensor on the host or creates one off the weights' device
(tests/unit/models/test_engine.py runs them on torch's ``meta`` device, where either would raise), and
both compile with ``torch.compile(fullgraph=True)``: on a GPU they are ready for CUDA graphs.
The host boundary is ``Engine.run``: one tensor of token ids in, logits out.

Padding: a slot with n of T rows computes the other T - n at position 0 and writes their keys and
values to the last position of its cache, a scratch position no sequence reaches (the capacity
keeps it spare); their logits are never read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Arch:
    """The shapes a Llama-family checkpoint's config gives."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float

    @classmethod
    def of(cls, config) -> Arch:
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            vocab=int(config.vocab_size),
            hidden=int(config.hidden_size),
            layers=int(config.num_hidden_layers),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            eps=float(config.rms_norm_eps),
        )


class Layer(NamedTuple):
    """One decoder layer's weights, q|k|v and gate|up fused (one matmul each)."""

    ln1: torch.Tensor  # [H]
    qkv: torch.Tensor  # [(heads + 2 kv_heads) * D, H]
    o: torch.Tensor  # [H, heads * D]
    ln2: torch.Tensor  # [H]
    gate_up: torch.Tensor  # [2 I, H]
    down: torch.Tensor  # [H, I]


@dataclass
class Weights:
    """A Llama decoder's weights on one device, and its rotary frequencies."""

    arch: Arch
    embed: torch.Tensor  # [V, H]
    layers: list[Layer]
    norm: torch.Tensor  # [H]
    head: torch.Tensor  # [V, H] (the embedding itself where tied)
    inv_freq: torch.Tensor  # [D / 2] float32
    rope_scale: float  # transformers' attention_scaling of cos and sin

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @classmethod
    def of(cls, model: torch.nn.Module) -> Weights:
        """The weights of a transformers Llama causal LM (shared where they can be: the fused
        q|k|v and gate|up are copies, the rest the model's own tensors)."""
        inner, arch = model.model, Arch.of(model.config)
        with torch.no_grad():
            layers = [
                Layer(
                    lay.input_layernorm.weight.detach(),
                    torch.cat(
                        [
                            lay.self_attn.q_proj.weight,
                            lay.self_attn.k_proj.weight,
                            lay.self_attn.v_proj.weight,
                        ]
                    ),
                    lay.self_attn.o_proj.weight.detach(),
                    lay.post_attention_layernorm.weight.detach(),
                    torch.cat([lay.mlp.gate_proj.weight, lay.mlp.up_proj.weight]),
                    lay.mlp.down_proj.weight.detach(),
                )
                for lay in inner.layers[: arch.layers]
            ]
        rotary = inner.rotary_emb
        return cls(
            arch,
            inner.embed_tokens.weight.detach(),
            layers,
            inner.norm.weight.detach(),
            model.lm_head.weight.detach(),
            rotary.inv_freq.detach().float(),
            float(rotary.attention_scaling),
        )


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the engine cannot run ``model`` (None: it can): it reproduces Llama's decoder with
    rotary scalings that do not change with the sequence length, and no biases."""
    from transformers.models.llama import modeling_llama as ml

    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) != "llama":
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not llama"
    if type(model) is not ml.LlamaForCausalLM:
        return f"{type(model).__name__} is not transformers' LlamaForCausalLM"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "attention or MLP biases"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    rope = model.model.rotary_emb
    if "dynamic" in str(rope.rope_type) or rope.rope_type == "longrope":
        return f"rope type {rope.rope_type!r} rescales with the sequence length"
    odd = {type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__}
    odd -= {"Linear"}
    if odd:
        return f"linear layers other than torch's ({', '.join(sorted(odd))})"
    if len({p.device for p in model.parameters()}) > 1:
        return "weights on several devices (the engine runs a stage on one)"
    return None


@dataclass
class KVCache:
    """Keys and values of S slots, C positions each: [layers, S, kv_heads, C, D]. The last
    position of every slot is scratch (padded rows write there), so a slot holds C - 1."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def empty(
        cls, arch: Arch, slots: int, capacity: int, device: torch.device, dtype: torch.dtype
    ) -> KVCache:
        shape = (arch.layers, slots, arch.kv_heads, capacity, arch.head_dim)
        return cls(
            torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype)
        )

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def resized(self, slots: int, capacity: int) -> KVCache:
        """A cache of ``slots`` x ``capacity`` holding this one's contents (one copy)."""
        arch_shape = (self.k.shape[0], slots, self.k.shape[2], capacity, self.k.shape[4])
        out = KVCache(self.k.new_zeros(arch_shape), self.v.new_zeros(arch_shape))
        s, c = min(slots, self.slots), min(capacity, self.capacity) - 1  # the old scratch is not kept
        out.k[:, :s, :, :c].copy_(self.k[:, :s, :, :c])
        out.v[:, :s, :, :c].copy_(self.v[:, :s, :, :c])
        return out


def rope_table(w: Weights, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [capacity, D] in the weights' dtype, as LlamaRotaryEmbedding computes them."""
    pos = torch.arange(capacity, device=w.device, dtype=torch.float32)
    freqs = pos[:, None] * w.inv_freq.to(w.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * w.rope_scale).to(w.dtype), (emb.sin() * w.rope_scale).to(w.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [S, T, heads, D] rotated at cos, sin [S, T, 1, D] (rotate_half, as Llama)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def forward(
    w: Weights,
    cache: KVCache,
    slots: slice,
    tokens: torch.Tensor,  # [S, T] int64: each slot's new tokens, padded
    start: torch.Tensor,  # [S] int64: each slot's length before them (its first new position)
    count: torch.Tensor,  # [S] int64: how many of the T are real
    cos: torch.Tensor,  # [C, D] (rope_table)
    sin: torch.Tensor,
    last_only: bool = False,
) -> torch.Tensor:
    """Logits [S, T, V] float32 of every row (``last_only``: [S, V] of row T - 1, a prefill's),
    writing each slot's new keys and values into ``cache`` at ``slots`` (a contiguous range, so
    the cache is viewed, never copied)."""
    a = w.arch
    s_n, t_n = tokens.shape
    cap = cache.capacity
    steps = torch.arange(t_n, device=tokens.device)
    real = steps[None, :] < count[:, None]  # [S, T]
    pos = torch.where(real, start[:, None] + steps[None, :], 0)  # padding: position 0 (never kept)
    write = torch.where(real, pos, cap - 1)  # padding writes the scratch position
    rows = torch.arange(s_n, device=tokens.device)[:, None].expand(s_n, t_n)
    visible = (
        torch.arange(cap, device=tokens.device)[None, None, None, :] <= pos[:, None, :, None]
    )  # [S,1,T,C]
    c, s = cos[pos][:, :, None, :], sin[pos][:, :, None, :]  # [S, T, 1, D]
    qn, kn = a.heads * a.head_dim, a.kv_heads * a.head_dim
    x = w.embed[tokens]  # [S, T, H]
    for i, lay in enumerate(w.layers):
        h = _rms_norm(x, lay.ln1, a.eps)
        q, k, v = (h @ lay.qkv.T).split((qn, kn, kn), dim=-1)
        q = _rotate(q.view(s_n, t_n, a.heads, a.head_dim), c, s)
        k = _rotate(k.view(s_n, t_n, a.kv_heads, a.head_dim), c, s)
        ck, cv = cache.k[i, slots], cache.v[i, slots]  # [S, kv_heads, C, D] views
        ck[rows, :, write] = k
        cv[rows, :, write] = v.view(s_n, t_n, a.kv_heads, a.head_dim)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), ck, cv, attn_mask=visible, scale=1.0 / math.sqrt(a.head_dim),
            enable_gqa=a.heads != a.kv_heads,
        )  # fmt: skip
        x = x + att.transpose(1, 2).reshape(s_n, t_n, qn) @ lay.o.T
        h = _rms_norm(x, lay.ln2, a.eps)
        gate, up = (h @ lay.gate_up.T).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ lay.down.T
    if last_only:
        x = x[:, -1]
    return (_rms_norm(x, w.norm, a.eps) @ w.head.T).float()
