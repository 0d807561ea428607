"""The stage engine: the one Llama-family decoder forward every device runs, its parts plug-ins.

gpt-fast's shape: one forward (``forward``) over plain data (``Weights``) whose linear layers are
whatever modules the model was given (torch's ``Linear``, the CPU kernels' ``FlatLinear`` and
``LowBitLinear``, a dynamic int8 copy's), whose attention is a back-end (models/attention.py:
SDPA over a padded grid of slots, SDPA one row at a time, the CPU row kernel) and whose MLP
activation is a hook. The KV cache (``KVCache``) holds S slots of C positions per layer; a
rollback moves a slot's host-side length, nothing on the device.

``forward`` runs the rows of a ``Batch``: each row one token of one slot at its own position,
its keys and values written into its slot's cache, its logits kept or not. Nothing in it reads a
tensor on the host or creates one off the weights' devices (tests/unit/models/test_engine.py runs
it on torch's ``meta`` device). Which rows travel together, and how they are laid out, is the
host's (models/scorer.py ``Engine``) and the attention back-end's. A stage too large for one GPU
has its decoder layers split over its GPUs in contiguous runs (models/split.py): the rows move on at
each boundary (``moved``: activations and indices, never weights or cache).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pipespec_mpi.models.attention import GridAttention
from pipespec_mpi.models.int4 import Int4Linear
from pipespec_mpi.models.rows import Attention, Batch

Linear = Callable[[torch.Tensor], torch.Tensor]  # [..., in] -> [..., out]: a module or a function

# torch runs an element-wise op of fewer elements on one thread (at::internal::GRAIN_SIZE)
_GRAIN = 32768


@dataclass(frozen=True)
class Arch:
    """The shapes a Llama-family checkpoint's config gives (plain ints and bools: constants to a
    compiler)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    gqa: bool  # heads != kv_heads
    scale: float  # head_dim ** -0.5, as LlamaAttention's ``scaling``

    @classmethod
    def of(cls, config) -> Arch:
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        return cls(
            vocab=int(config.vocab_size),
            hidden=int(config.hidden_size),
            intermediate=int(config.intermediate_size),
            layers=int(config.num_hidden_layers),
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            eps=float(config.rms_norm_eps),
            gqa=heads != kv_heads,
            scale=head_dim**-0.5,
        )


class Layer(NamedTuple):
    """One decoder layer: its norms' weights and its linears (q|k|v and gate|up fused)."""

    ln1: torch.Tensor  # [H]
    qkv: Linear  # H -> (heads + 2 kv_heads) * D
    o: Linear  # heads * D -> H
    ln2: torch.Tensor  # [H]
    gate_up: Linear  # H -> 2 I
    down: Linear  # I -> H


def silu(gate: torch.Tensor, b: Batch) -> torch.Tensor:
    """The MLP's activation (a hook: ``act(gate, batch)``)."""
    return F.silu(gate)


def silu_by_rows(gate: torch.Tensor, b: Batch) -> torch.Tensor:
    """SiLU of ``gate`` [R, W] with torch's split of the op fixed by each sequence's rows alone (the
    CPU's activation). torch splits an element-wise op of _GRAIN elements or more over its threads
    at element offsets, and its vectorised and scalar SiLU differ in the last bit, so such calls
    run per piece of rows under _GRAIN (one thread each); where a row is not a whole number of
    vectors, per sequence of a ragged batch, so that its rows fall as in a forward of their own."""
    gate = gate.contiguous()
    r, width = gate.shape
    spans = [(0, r)] if width % 64 == 0 or not b.seqs else list(zip(b.bounds, b.bounds[1:]))
    step = max(1, _GRAIN // width)
    pieces = [(a, min(a + step, hi)) for lo, hi in spans for a in range(lo, hi, step)]
    if len(pieces) == 1:
        return F.silu(gate)
    return torch.cat([F.silu(gate[a:z]) for a, z in pieces])


@dataclass
class Weights:
    """A Llama decoder: its tensors, its linears and its plug-ins; on one device, or its decoder
    layers split over several in contiguous runs (models/split.py), the embedding on the first."""

    arch: Arch
    embed: torch.Tensor  # [V, H]
    layers: list[Layer]
    norm: torch.Tensor  # [H]
    head: Linear  # H -> V
    inv_freq: torch.Tensor  # [D / 2] float32
    rope_scale: float  # transformers' attention_scaling of cos and sin
    attention: Attention = field(default=None)  # type: ignore[assignment]  # set by ``of``
    act: Callable[[torch.Tensor, Batch], torch.Tensor] = silu  # the MLP's activation

    @property
    def device(self) -> torch.device:
        """Where a forward starts: the embedding's device (the rows' indices are copied there)."""
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def linears(self) -> Iterator[Linear]:
        """Every linear it computes with (the LM head last)."""
        for lay in self.layers:
            yield from map(module_of, (lay.qkv, lay.o, lay.gate_up, lay.down))
        yield module_of(self.head)

    def uncompilable(self) -> str | None:
        """Why torch.compile cannot take the forward whole (None: it can): every plug-in must be
        torch's own (the CPU kernels are extensions dynamo cannot trace)."""
        if self.attention.layout != "grid":
            return f"attention {self.attention!r} is not torch's"
        parts = [p for m in self.linears() for p in (m.parts if isinstance(m, Concat) else [m])]
        odd = sorted(
            {type(p).__name__ for p in parts if type(p) not in (torch.nn.Linear, Float32Head, Int4Linear)}
        )
        if odd:
            return f"linears {', '.join(odd)} are not torch's"
        if self.act is not silu:
            return f"activation {getattr(self.act, '__name__', self.act)} is not torch's SiLU"
        return None

    @property
    def max_rows(self) -> int | None:
        """The most rows a forward may carry with each row computed as if alone by every linear
        (their ``max_rows``), or None where no linear promises it."""
        limits = [n for m in self.linears() if (n := getattr(m, "max_rows", None)) is not None]
        return min(limits, default=None)

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        attention: Attention | None = None,
        act: Callable[[torch.Tensor, Batch], torch.Tensor] | None = None,
    ) -> Weights:
        """The engine's view of a transformers Llama causal LM: its own tensors and linear
        modules as they are (swapped for kernels or not), q|k|v and gate|up each fused into one
        (the parts' weights become views of the fused ones where the kind allows, else the
        parts are called side by side). ``attention``: SDPA over a grid by default."""
        inner, arch = model.model, Arch.of(model.config)
        with torch.no_grad():
            layers = [
                Layer(
                    static(lay.input_layernorm.weight.detach()),
                    direct(fuse([lay.self_attn.q_proj, lay.self_attn.k_proj, lay.self_attn.v_proj])),
                    direct(lay.self_attn.o_proj),
                    static(lay.post_attention_layernorm.weight.detach()),
                    direct(fuse([lay.mlp.gate_proj, lay.mlp.up_proj])),
                    direct(lay.mlp.down_proj),
                )
                for lay in inner.layers[: arch.layers]
            ]
        rotary = inner.rotary_emb
        return cls(
            arch,
            static(inner.embed_tokens.weight.detach()),
            layers,
            static(inner.norm.weight.detach()),
            float32_head(model.lm_head),
            rotary.inv_freq.detach().float(),
            float(rotary.attention_scaling),
            attention if attention is not None else GridAttention(),
            act if act is not None else silu,
        )


class Float32Head(torch.nn.Module):
    """A half-precision dense LM head whose logits leave it in float32, not rounded to half first
    (in bf16 about one position in 30 of code is an exact top-2 tie: docs/gpu.md, "Numerics").
    CUDA: the matmul's own float32 output (``mm`` with ``out_dtype``); elsewhere the weight is
    kept once in float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.on_device = weight.device.type in ("cuda", "meta")
        self.weight = static(weight.detach() if self.on_device else weight.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_device:
            return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        return torch.nn.functional.linear(x.float(), self.weight)


def float32_head(m: Linear) -> Linear:
    """The LM head as the engine calls it: a half-precision ``nn.Linear`` through ``Float32Head``,
    any other as it is (its output made float32 by the forward)."""
    w = getattr(m, "weight", None)
    if type(m) is torch.nn.Linear and w is not None and w.dtype in (torch.float16, torch.bfloat16):
        return direct(Float32Head(w))
    return direct(m)


def direct(m: Linear) -> Linear:
    """A linear module's own ``forward`` (nn.Module's ``__call__`` costs ~5 us of hook checks,
    ~0.6 ms over a small model's 121 linears a step; the engine refuses models with hooks)."""
    return m.forward if isinstance(m, torch.nn.Module) else m


def module_of(f: Linear) -> Linear:
    """The module behind a ``direct`` linear (the linear itself where it is a plain function)."""
    owner = getattr(f, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else f


class Concat(torch.nn.Module):
    """Linears side by side: their outputs concatenated (for kinds that cannot fuse)."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.max_rows = min(
            (n for p in parts if (n := getattr(p, "max_rows", None)) is not None), default=None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def fuse(parts: list[torch.nn.Module]) -> torch.nn.Module:
    """One linear computing ``parts`` side by side, each output bitwise its part's where the kind
    fuses (``concat``: the kernels' layers; torch's ``Linear``), else a ``Concat``."""
    kind = type(parts[0])
    if all(type(p) is kind for p in parts):
        if hasattr(kind, "concat"):
            fused = kind.concat(parts)
            if fused is not None:
                return fused
        if kind is torch.nn.Linear and all(p.bias is None for p in parts):
            weight = torch.cat([p.weight.detach() for p in parts])
            out = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            out.weight = torch.nn.Parameter(weight, requires_grad=False)
            start = 0
            for p in parts:  # the parts become views of the fused weight (no second copy)
                n = p.weight.shape[0]
                p.weight = torch.nn.Parameter(weight[start : start + n], requires_grad=False)
                start += n
            return out
    return Concat(parts)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the engine cannot run ``model`` (None: it can): it reproduces transformers' Llama
    decoder (no biases, SiLU, rotary scalings that do not change with the sequence length) on
    one device, with the model's linear modules whatever their kind."""
    from transformers.models.llama import modeling_llama as ml

    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) != "llama":
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not llama"
    if type(model) is not ml.LlamaForCausalLM or type(model.model) is not ml.LlamaModel:
        return f"{type(model).__name__} is not transformers' LlamaForCausalLM"
    if not getattr(cfg, "is_causal", True):
        return "config.is_causal is False (bidirectional attention)"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "attention or MLP biases"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    rope = model.model.rotary_emb
    if type(rope) is not ml.LlamaRotaryEmbedding:
        return f"rotary embedding {type(rope).__name__} is not LlamaRotaryEmbedding"
    if not isinstance(rope.rope_type, str) or "dynamic" in rope.rope_type or rope.rope_type == "longrope":
        return f"rope type {rope.rope_type!r} rescales with the sequence length"
    embed = model.model.embed_tokens
    if type(embed) is not torch.nn.Embedding or embed.max_norm is not None:
        return f"embedding {type(embed).__name__} is not a plain nn.Embedding"
    if len(model.model.layers) < cfg.num_hidden_layers:
        return f"{len(model.model.layers)} layers for num_hidden_layers={cfg.num_hidden_layers}"
    for i, layer in enumerate(model.model.layers[: cfg.num_hidden_layers]):
        if type(layer) is not ml.LlamaDecoderLayer:
            return f"layer {i} is {type(layer).__name__}"
        if type(layer.self_attn) is not ml.LlamaAttention or type(layer.mlp) is not ml.LlamaMLP:
            return f"layer {i}: attention/MLP classes are not Llama's"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(m) is not ml.LlamaRMSNorm for m in norms):
            return f"layer {i}: norm is not LlamaRMSNorm"
    for name, mod in model.named_modules():
        if mod._forward_hooks or mod._forward_pre_hooks or hasattr(mod, "_hf_hook"):
            return f"module {name or type(mod).__name__} has forward hooks"
    tensors = [*model.parameters(), *model.buffers()]
    if len({t.device for t in tensors}) > 1:  # a split (``spread``): each layer on one device
        inner = model.model
        for i, layer in enumerate(inner.layers):
            if len({t.device for t in [*layer.parameters(), *layer.buffers()]}) > 1:
                return f"decoder layer {i} spans several devices"
        if inner.norm.weight.device != model.lm_head.weight.device:
            return "the final norm and the LM head on different devices"
    return None


class LayerKV(NamedTuple):
    """One layer's keys and values [S, kv_heads, C, D], written in place, and each slot's views of
    them [kv_heads, C, D] (made once: a ragged write costs no indexing ops)."""

    k: torch.Tensor
    v: torch.Tensor
    k_slots: tuple[torch.Tensor, ...]
    v_slots: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> LayerKV:
        return cls(k, v, k.unbind(0), v.unbind(0))

    def write(self, b: Batch, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """The rows' keys (rotated here) and values [R, kv_heads, D]: a ragged batch's sequences
        each rotated straight into its slot's positions (they are contiguous), a grid's rows
        scattered."""
        if b.seqs:
            if len(b.seqs) == 1:  # one sequence (a CPU stage's forward): its rows as they are
                ((slot, start, n),) = b.seqs
                rotate(k, cos, sin, out=self.k_slots[slot].narrow(1, start, n).transpose(0, 1))
                self.v_slots[slot].narrow(1, start, n).transpose(0, 1).copy_(v)
                return
            for (slot, start, n), lo in zip(b.seqs, b.bounds, strict=False):
                rows = slice(lo, lo + n)
                out = self.k_slots[slot].narrow(1, start, n).transpose(0, 1)
                rotate(k[rows], cos[rows], sin[rows], out=out)
                self.v_slots[slot].narrow(1, start, n).transpose(0, 1).copy_(v[rows])
            return
        self.k[b.slot, :, b.write] = rotate(k, cos, sin)
        self.v[b.slot, :, b.write] = v


@dataclass
class KVCache:
    """Keys and values of S slots, C positions each, per layer (``LayerKV``), and the rotary tables
    of the C positions. The last position of every slot is scratch (padding rows write there), so
    a slot holds C - 1."""

    layers: list[LayerKV]
    cos: torch.Tensor  # [C, D] in the weights' dtype
    sin: torch.Tensor  # [C, D], its first half negated (``rotate``)

    @classmethod
    def empty(cls, w: Weights, slots: int, capacity: int) -> KVCache:
        a = w.arch
        shape = (slots, a.kv_heads, capacity, a.head_dim)

        def buffer(lay: Layer) -> torch.Tensor:  # on the layer's device (a split: models/split.py)
            return static(torch.zeros(shape, device=lay.ln1.device, dtype=w.dtype))

        layers = [LayerKV.of(buffer(lay), buffer(lay)) for lay in w.layers]
        return cls(layers, *map(static, rope_table(w, capacity)))

    @property
    def k(self) -> list[torch.Tensor]:
        return [kv.k for kv in self.layers]

    @property
    def v(self) -> list[torch.Tensor]:
        return [kv.v for kv in self.layers]

    @property
    def slots(self) -> int:
        return self.layers[0].k.shape[0]

    @property
    def capacity(self) -> int:
        return self.layers[0].k.shape[2]

    def resized(self, w: Weights, slots: int, capacity: int) -> KVCache:
        """A cache of ``slots`` x ``capacity`` holding this one's contents (one copy)."""
        out = KVCache.empty(w, slots, capacity)
        s, c = min(slots, self.slots), min(capacity, self.capacity) - 1  # the old scratch is not kept
        for new, old in zip((*out.k, *out.v), (*self.k, *self.v), strict=True):
            new[:s, :, :c].copy_(old[:s, :, :c])
        return out


def static(t: torch.Tensor) -> torch.Tensor:
    """``t``, its address fixed for CUDA graphs (a captured graph reads and writes it in place
    instead of copying it in on every replay)."""
    if t.device.type == "cuda":
        torch._dynamo.mark_static_address(t)
    return t


def rope_table(w: Weights, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [capacity, D] in the weights' dtype, as LlamaRotaryEmbedding computes
    cos and sin (in float32, scaled, then cast)."""
    pos = torch.arange(capacity, device=w.device, dtype=torch.float32)
    freqs = pos[:, None] * w.inv_freq.to(w.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * w.rope_scale).to(w.dtype), (emb.sin() * w.rope_scale).to(w.dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward, op for op (in place where the value is a fresh temporary)."""
    dtype = h.dtype
    if dtype is not torch.float32:
        h = h.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * variance.add_(eps).rsqrt_()
    if dtype is not torch.float32:
        h = h.to(dtype)
    if weight.dtype is dtype:
        return h.mul_(weight)  # weight * h: the same products
    return weight * h


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Llama's ``x * cos + rotate_half(x) * sin`` as ``x * cos + roll(x, D/2) * sin`` with the
    signed sin of ``rope_table``: the same products ((-a) * b == a * (-b)), 4 ops instead of 7."""
    return torch.add(x * cos, torch.roll(x, x.shape[-1] // 2, -1) * sin, out=out)


def forward(w: Weights, cache: KVCache, b: Batch, layer: LayerFn | None = None) -> torch.Tensor:
    """Logits [K, V] float32 of the rows ``b.keep``, every row's keys and values written into
    ``cache``. ``layer``: how each decoder layer runs (``decoder_layer``, or it compiled:
    models/scorer.py ``compile_forward``)."""
    layer = layer or decoder_layer
    cos, sin = cache.cos[b.pos][:, None, :], cache.sin[b.pos][:, None, :]  # [R, 1, D]
    x = w.embed[b.tokens]  # [R, H]
    for lay, kv in zip(w.layers, cache.layers, strict=True):
        if kv.k.device != x.device:  # the next device of a split: the rows and their batch move on
            x, cos, sin, b = moved(kv.k.device, x, cos, sin, b)
        x = layer(w, lay, kv, x, cos, sin, b)
    if w.norm.device != x.device:
        x, cos, sin, b = moved(w.norm.device, x, cos, sin, b)
    x = rms_norm(x[b.keep], w.norm, w.arch.eps)
    return w.head(x).float()


def moved(
    device: torch.device, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: Batch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Batch]:
    """The hidden rows, their rotary rows and the batch's indices on ``device`` (a split's next
    GPU: R x H activations and 5 x R indices, never the weights or the cache)."""
    to = functools.partial(torch.Tensor.to, device=device, non_blocking=True)
    return to(x), to(cos), to(sin), dataclasses.replace(b, rows=to(b.rows))


def decoder_layer(
    w: Weights, lay: Layer, kv: LayerKV, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: Batch
) -> torch.Tensor:
    """One decoder layer over the rows ``x`` [R, H]: their keys and values written into ``kv``.
    Its own function so that a compiler takes it once for every layer (the same code; compile time
    independent of depth: docs/gpu.md, "Compile time")."""
    a = w.arch
    r = x.shape[0]
    h = rms_norm(x, lay.ln1, a.eps)
    q, k, v = lay.qkv(h).view(r, -1, a.head_dim).split((a.heads, a.kv_heads, a.kv_heads), dim=1)
    q = rotate(q, cos, sin)
    kv.write(b, k, v, cos, sin)
    x = x + lay.o(w.attention(q, kv.k, kv.v, b, a.scale))
    h = rms_norm(x, lay.ln2, a.eps)
    gate_up = lay.gate_up(h)
    gate, up = gate_up[:, : a.intermediate], gate_up[:, a.intermediate :]
    return x + lay.down(w.act(gate, b) * up)


# decoder_layer's signature: (weights, layer, its cache, rows, cos, sin, batch) -> rows
LayerFn = Callable[[Weights, Layer, LayerKV, torch.Tensor, torch.Tensor, torch.Tensor, Batch], torch.Tensor]
