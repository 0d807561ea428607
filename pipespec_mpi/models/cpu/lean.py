"""A lean forward for Llama-family decoders: transformers' torch ops without transformers' framework.

A stage's forward through transformers (``LlamaForCausalLM`` with ``FlatLinear``, the preallocated
cache and ``sdpa_gqa``) pays per layer for module calls, keyword plumbing, mask and position
bookkeeping, per-layer cos/sin unsqueezes, cache dispatch and output dataclasses. ``LeanLlama``
runs the same computation as one flat loop over the layers: the model's own parameters and
linear modules (called through ``forward``; q|k|v and gate|up fused where
``flat_linear.fuse_linears`` offers it, for the small-row sizes whose outputs do not depend on
the width), RMSNorm, RoPE, SDPA, residuals and MLP as transformers writes them, on tensors of
the same shapes and strides, so the logits are bitwise those of the transformers forward
(tests/unit/models/cpu/test_lean.py compares them with torch.equal). Rewrites are kept only where
they are exact: RoPE's ``rotate_half(x) * sin`` is ``roll(x, D/2) * sin_s`` with the first half of
``sin`` negated (the same products), the boolean mask becomes SDPA's additive one once per
forward instead of once per layer (what SDPA does with it), the rotated keys are written
straight into the ``PreallocatedLayer`` buffers (``crop`` rolls back as before). Precomputed
once: a cos/sin table from the rotary module itself, checked bitwise against it on windows of
every verification length (the rotary module is called per forward otherwise), and the position
indices the causal mask is built from, exactly as ``sdpa_mask`` builds it and only where it does.

For a small model the framework's per-layer overhead is a noticeable share of a CPU forward, and
this loop removes most of it (docs/notebook.md, "Measurements behind the code's choices").

``rows_alone`` (a stage's ``exact_rows``) departs from transformers on purpose: every decoding
row's attention computed alone (the row attention kernel, models/cpu/attention.py), so that a row's
logits do not depend on the rows beside it.

Anything the loop does not reproduce (another architecture, rope types that rescale with the
sequence length, hooks, another attention implementation, a non-CPU device) makes ``build_lean``
return None with the reason, and the caller keeps the transformers forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv as _repeat_kv
from transformers.integrations.sdpa_attention import use_gqa_in_sdpa as _use_gqa_in_sdpa

from pipespec_mpi.models.cpu.attention import attend_rows_alone, rows_kernel
from pipespec_mpi.models.cpu.lean_support import _rms_norm, _rotate, _signed, unsupported_reason
from pipespec_mpi.models.kv_cache import PreallocatedLayer

if TYPE_CHECKING:
    from transformers import Cache

log = logging.getLogger("pipespec_mpi")

# Window lengths checked when the cos/sin table is built: every verification size and a few
# prefill lengths, at several offsets.
_PROBE_LENGTHS = (*range(1, 18), 31, 33, 64, 100)
_TABLE_START = 512  # positions in the first table; it doubles when a sequence outgrows it
_GRAIN = 32768  # at::internal::GRAIN_SIZE: torch runs an element-wise op of fewer on one thread

Linear = Callable[[torch.Tensor], torch.Tensor]


def _forward_of(module: torch.nn.Module) -> Linear:
    """The module's ``forward`` (no ``__call__`` machinery: hooks are refused at build)."""
    return module.forward


def _activation(act: torch.nn.Module) -> Linear:
    """The MLP activation: torch's silu op itself where the module only calls it, else the
    module's forward."""
    from transformers.activations import SiLUActivation

    if type(act) is SiLUActivation or (type(act) is torch.nn.SiLU and not act.inplace):
        return torch._C._nn.silu  # what F.silu(x) calls
    return act.forward


class _Layer:
    """One decoder layer's parameters and callables, flattened for the loop."""

    __slots__ = (
        "idx", "ln1_w", "ln1_eps", "ln2_w", "ln2_eps", "qkv", "q", "k", "v", "o",
        "gate_up", "gate", "up", "down", "act",
    )  # fmt: skip

    def __init__(self, idx: int, layer: torch.nn.Module, fuse: Callable | None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.idx = idx
        self.ln1_w = layer.input_layernorm.weight
        self.ln1_eps = layer.input_layernorm.variance_epsilon
        self.ln2_w = layer.post_attention_layernorm.weight
        self.ln2_eps = layer.post_attention_layernorm.variance_epsilon
        qkv = fuse([attn.q_proj, attn.k_proj, attn.v_proj]) if fuse is not None else None
        self.qkv = _forward_of(qkv) if qkv is not None else None
        self.q, self.k, self.v = (_forward_of(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        self.o = _forward_of(attn.o_proj)
        gate_up = fuse([mlp.gate_proj, mlp.up_proj]) if fuse is not None else None
        self.gate_up = _forward_of(gate_up) if gate_up is not None else None
        self.gate, self.up, self.down = (_forward_of(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        self.act = _activation(mlp.act_fn)

    def qkv_heads(
        self, x: torch.Tensor, fused: bool, shape: tuple[int, ...], split: tuple[int, int, int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as [1, heads, T, D] views of the projections of ``x`` [1, T, H] (one fused call
        where allowed: the same views as per part)."""
        if fused and self.qkv is not None:
            q, k, v = self.qkv(x).view(shape).transpose(1, 2).split(split, 1)
            return q, k, v
        return tuple(f(x).view(shape).transpose(1, 2) for f in (self.q, self.k, self.v))

    def mlp(self, x: torch.Tensor, fused: bool, bounds: list[int] | None = None) -> torch.Tensor:
        """down(act(gate(x)) * up(x)) as LlamaMLP computes it. ``bounds``: the row ranges of the
        sequences sharing ``x``, where the activation must run per sequence (see forward_batch)."""
        if fused and self.gate_up is not None:
            gu = self.gate_up(x)
            n = gu.shape[-1] // 2
            # contiguous: the activation's vectorised/scalar split then falls on the same
            # elements as for the separate gate output (SiLU's two paths differ in the last bit)
            gate, up = gu[..., :n].contiguous(), gu[..., n:]
        else:
            gate, up = self.gate(x), self.up(x)
        return self.down(_pieces(self.act, gate, bounds) * up)


def _pieces(act: Linear, gate: torch.Tensor, bounds: list[int] | None) -> torch.Tensor:
    """``act(gate)`` [1, T, W] with its vector/scalar split fixed by the rows alone. torch splits
    an element-wise op of _GRAIN elements or more over its threads at element offsets, and the
    vectorised and scalar activations differ in the last bit, so such calls run per piece of rows
    under _GRAIN (one thread each). ``bounds``: the sequences sharing ``gate``; where rows do not
    start on a vector boundary, each sequence's pieces fall as in its own forward."""
    t, width = gate.shape[1], gate.shape[-1]
    spans = [(0, t)] if bounds is None or width % 64 == 0 else list(zip(bounds, bounds[1:]))
    step = max(1, _GRAIN // width)  # a row wider than _GRAIN still splits (none on CPU targets)
    pieces = [(a, min(a + step, hi)) for lo, hi in spans for a in range(lo, hi, step)]
    if len(pieces) == 1:
        return act(gate)
    return torch.cat([act(gate[:, a:b]) for a, b in pieces], dim=1)


class LeanLlama:
    """The forward of a transformers Llama causal LM as one flat loop (see the module docstring).

    Built from the model as it will run (linear modules swapped, attention implementation set):
    it keeps references to the model's parameters and modules, never copies of them.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        from pipespec_mpi.models.cpu import flat_linear

        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"lean forward unsupported: {reason}")
        cfg = model.config
        inner = model.model
        self.model = model
        self.n_layers = int(cfg.num_hidden_layers)
        attn0 = inner.layers[0].self_attn
        self.head_dim = int(attn0.head_dim)
        self.groups = int(attn0.num_key_value_groups)
        self.scaling = attn0.scaling
        self.head_split = (
            int(cfg.num_attention_heads),
            int(cfg.num_key_value_heads),
            int(cfg.num_key_value_heads),
        )
        self.impl = cfg._attn_implementation
        self.embed = _forward_of(inner.embed_tokens)
        self.norm_w = inner.norm.weight
        self.norm_eps = inner.norm.variance_epsilon
        self.lm_head = _forward_of(model.lm_head)
        self.rotary = inner.rotary_emb
        self.dtype = inner.embed_tokens.weight.dtype
        self.device = inner.embed_tokens.weight.device
        fuse = getattr(flat_linear, "fuse_linears", None)
        self.fuse_rows = int(getattr(flat_linear, "MAX_ROWS", 16))
        self.layers = [_Layer(i, inner.layers[i], fuse) for i in range(self.n_layers)]
        self.fused = sum((lay.qkv is not None) + (lay.gate_up is not None) for lay in self.layers)
        # rows_alone's attention: kernels/attention.cpp where it builds (float32), else per-row SDPA
        self.rows_kernel = rows_kernel() if self.dtype == torch.float32 else None
        self._cache_ok: object | None = None  # the last cache checked for a supported layout
        self._cap = 0
        self._table = True  # False: cos/sin come from the rotary module at every forward
        self._grow(_TABLE_START)

    @property
    def batchable(self) -> bool:
        """``forward_batch`` runs here (it needs the cos/sin table, and sdpa_gqa for grouped heads)."""
        return self._table and not (self.groups > 1 and self.impl == "sdpa")

    # ---- positions: indices, cos/sin table --------------------------------------------------

    def _rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dummy = torch.empty(0, dtype=self.dtype, device=self.device)
        return self.rotary.forward(dummy, position_ids)

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self._cap, _TABLE_START)
        self._ar = torch.arange(cap, device=self.device)
        self._cap = cap
        if not self._table:
            return
        cos, sin = self._rope(self._ar[None])  # [1, cap, D]
        self._cos, self._sin = cos[0], sin[0]
        self._sin_s = _signed(self._sin)
        # The table is what the rotary module gives for every window (transformers calls it on
        # arange(T) + past), checked bitwise on windows of every small length at a few offsets.
        for t in _PROBE_LENGTHS:
            for off in sorted({0, 1, 7, 200, cap - t}):
                if off < 0 or off + t > cap:
                    continue
                c, s = self._rope((torch.arange(t, device=self.device) + off).unsqueeze(0))
                if not (
                    torch.equal(c[0], self._cos[off : off + t])
                    and torch.equal(s[0], self._sin[off : off + t])
                ):
                    log.info(
                        "lean forward: cos/sin table differs from the rotary module; computing per forward"
                    )
                    self._table = False
                    del self._cos, self._sin, self._sin_s
                    return

    def _check_cache(self, cache: Cache) -> None:
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        if layers is None or len(layers) < self.n_layers:
            raise ValueError(f"lean forward: cache with {len(layers or [])} layers for {self.n_layers}")
        if getattr(cache, "offloading", False) or getattr(cache, "layer_class_to_replicate", None):
            raise ValueError("lean forward: offloading or lazily built caches are not supported")
        kinds = {type(lay) for lay in layers[: self.n_layers]}
        if not kinds <= {PreallocatedLayer, DynamicLayer}:
            raise ValueError(f"lean forward: cache layers {sorted(k.__name__ for k in kinds)}")
        self._cache_ok = cache

    # ---- the forward ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, cache: Cache, keep: int, rows_alone: bool = False
    ) -> torch.Tensor:
        """Logits [1, keep, V] of ``input_ids`` [1, T] after the ``cache``'s positions (which it
        extends), bitwise those of ``model(input_ids=..., cache=cache, logits_to_keep=keep)``;
        ``keep`` 0 keeps all positions. ``rows_alone``: every position's attention computed alone
        (the row kernel where it builds, else ``attend_rows_alone``), so that each row is bitwise
        what a forward of that token alone computes (not what transformers computes for the T
        tokens); a forward of one token then runs the row kernel too."""
        if cache is not self._cache_ok:
            self._check_cache(cache)
        if input_ids.shape[0] != 1:
            raise ValueError("lean forward: batch size 1 only")
        cache_layers = cache.layers
        t = input_ids.shape[1]
        past = cache_layers[0].get_seq_length()
        end = past + t
        if end > self._cap:
            self._grow(end)
        ar = self._ar

        h = self.embed(input_ids)  # [1, T, H]
        if self._table:  # [1, 1, T, D] views with the strides transformers' cos/sin have
            cos = self._cos[past:end].unsqueeze(0).unsqueeze(1)
            sin_s = self._sin_s[past:end].unsqueeze(0).unsqueeze(1)
        else:
            cos, sin = self._rope(ar[past:end].unsqueeze(0))
            cos, sin_s = cos.unsqueeze(1), _signed(sin).unsqueeze(1)
        # The mask as create_causal_mask/sdpa_mask build it: none for one query or an empty
        # cache (then SDPA's is_causal, as the sdpa integrations set it), else kv_idx <= q_idx;
        # turned into the additive mask SDPA makes of a boolean one, once instead of per layer.
        kernel = self.rows_kernel if rows_alone else None
        alone = rows_alone and t > 1 and kernel is None
        if t == 1 or past == 0 or alone or kernel is not None:
            mask = None
        else:
            mask = ar[:end][None, None, None, :] <= ar[past:end][None, None, :, None]
            mask = mask.expand(1, -1, t, end)
        causal = t > 1 and mask is None and not alone and kernel is None
        additive = mask is not None
        if self.groups > 1 and self.impl == "sdpa":
            per_layer_gqa = True  # transformers' sdpa decides on each layer's key/value
            sdpa_kw: dict = {}
        else:
            per_layer_gqa = False
            sdpa_kw = {"enable_gqa": True} if self.groups > 1 else {}
        hd, scaling, head_split = self.head_dim, self.scaling, self.head_split
        hidden_shape = (1, t, -1, hd)
        # Fused linears only for the small-row kernel's sizes, whose outputs are row- and
        # width-independent by construction; a prefill keeps torch's GEMM per part, as transformers.
        fused = t <= self.fuse_rows
        sdpa = F.scaled_dot_product_attention

        for lay in self.layers:
            residual = h
            x = _rms_norm(h, lay.ln1_w, lay.ln1_eps)
            q, k, v = lay.qkv_heads(x, fused, hidden_shape, head_split)
            q = _rotate(q, cos, sin_s)
            cl = cache_layers[lay.idx]
            if type(cl) is PreallocatedLayer:  # the rotated keys go straight into the buffer
                if not cl.is_initialized:
                    cl.lazy_initialization(v, v)
                start = cl.length
                stop = start + t
                if stop > cl.capacity:
                    cl._grow(stop)
                _rotate(k, cos, sin_s, out=cl._kbuf.narrow(2, start, t))
                cl._vbuf.narrow(2, start, t).copy_(v)
                cl.length = stop
                cl._views()
                k, v = cl.keys, cl.values
            else:
                k = _rotate(k, cos, sin_s)
                k, v = cl.update(k, v)
            if additive:  # what SDPA makes of the boolean mask (in the queries' dtype), made once
                mask = torch.where(mask, 0.0, torch.scalar_tensor(float("-inf"), dtype=q.dtype))
                additive = False
            if per_layer_gqa:  # plain sdpa: enable_gqa without a mask, else repeat_kv
                if _use_gqa_in_sdpa(mask, k, v):
                    sdpa_kw = {"enable_gqa": True}
                else:
                    sdpa_kw = {}
                    k, v = _repeat_kv(k, self.groups), _repeat_kv(v, self.groups)
            if causal and k.shape[2] > t:
                k, v = k[:, :, :t], v[:, :, :t]
            if kernel is not None:
                a = kernel(q, [k], [v], [0, t], scaling)  # [1, T, H_q * D]
            else:
                if alone:
                    a = attend_rows_alone(sdpa, q, k, v, scaling, sdpa_kw)
                else:
                    a = sdpa(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scaling, is_causal=causal,
                             **sdpa_kw)  # fmt: skip
                a = a.transpose(1, 2).contiguous()  # [1, T, H_q, D]
                a = a.reshape(1, t, -1).contiguous()
            h = residual + lay.o(a)

            residual = h
            x = _rms_norm(h, lay.ln2_w, lay.ln2_eps)
            h = residual + lay.mlp(x, fused)

        h = _rms_norm(h, self.norm_w, self.norm_eps)
        if keep > 0:
            h = h[:, -keep:, :]
        return self.lm_head(h)

    @torch.inference_mode()
    def forward_batch(
        self,
        tokens: list[list[int]],
        caches: list[Cache],
        keeps: list[int] | None = None,
        rows_alone: bool = False,
    ) -> torch.Tensor:
        """Logits of B sequences, each ``tokens[b]`` appended to its own ``caches[b]``: [B, V]
        for the last token of each, or with ``keeps`` the last ``keeps[b]`` positions of every
        sequence stacked in order ([sum keeps, V]). The linear layers, norms and MLP run once
        over all the rows ([1, sum T_b, H]), RoPE per row at its own position, attention per
        sequence over its own cache. Every row's logits are bitwise those of ``forward`` on that
        sequence alone when the rows fit the flat kernel (sum T_b <= 16: its outputs do not
        depend on the row count; norms and element-wise ops are per row). Causal attention
        within a sequence's new tokens is as in ``forward`` (no mask for one token; with
        ``rows_alone``, every row's attention computed alone: with the row kernel, one call per
        layer for all the sequences)."""
        if len(tokens) != len(caches) or not tokens:
            raise ValueError("lean forward_batch: one cache per sequence, at least one sequence")
        if not self._table:
            raise ValueError("lean forward_batch: needs the cos/sin table")
        if self.groups > 1 and self.impl == "sdpa":
            raise ValueError("lean forward_batch: grouped-query attention needs sdpa_gqa")
        for c in caches:
            if c is not self._cache_ok:
                self._check_cache(c)
        lens = [len(t) for t in tokens]
        pasts = [c.layers[0].get_seq_length() for c in caches]
        top = max(p + n for p, n in zip(pasts, lens, strict=True))
        if top > self._cap:
            self._grow(top)
        rows = sum(lens)
        ids = torch.tensor([[t for seq in tokens for t in seq]], dtype=torch.long, device=self.device)
        pos = torch.cat([self._ar[p : p + n] for p, n in zip(pasts, lens, strict=True)])  # [R]
        cos = self._cos[pos].unsqueeze(0).unsqueeze(1)  # [1, 1, R, D]
        sin_s = self._sin_s[pos].unsqueeze(0).unsqueeze(1)
        bounds = [0]
        for n in lens:
            bounds.append(bounds[-1] + n)
        hd, scaling, head_split = self.head_dim, self.scaling, self.head_split
        fused = rows <= self.fuse_rows
        sdpa = F.scaled_dot_product_attention
        gqa = {"enable_gqa": True} if self.groups > 1 else {}
        masks = []
        kernel = self.rows_kernel if rows_alone else None
        for p, n in zip(pasts, lens, strict=True):
            if n == 1 or p == 0 or rows_alone:
                masks.append(None)
            else:
                m = self._ar[: p + n][None, None, None, :] <= self._ar[p : p + n][None, None, :, None]
                masks.append(torch.where(m, 0.0, torch.scalar_tensor(float("-inf"), dtype=self.dtype)))

        h = self.embed(ids)  # [1, R, H]
        for lay in self.layers:
            residual = h
            x = _rms_norm(h, lay.ln1_w, lay.ln1_eps)
            q, k, v = lay.qkv_heads(x, fused, (1, rows, -1, hd), head_split)
            q = _rotate(q, cos, sin_s)
            k = _rotate(k, cos, sin_s)
            outs, ks, vs = [], [], []
            for b, cache in enumerate(caches):
                lo, hi = bounds[b], bounds[b + 1]
                kb, vb = cache.layers[lay.idx].update(k[:, :, lo:hi], v[:, :, lo:hi])
                n = hi - lo
                if kernel is not None:
                    ks.append(kb)
                    vs.append(vb)
                    continue
                if rows_alone and n > 1:
                    a = attend_rows_alone(sdpa, q[:, :, lo:hi], kb, vb, scaling, gqa)
                    outs.append(a.transpose(1, 2).reshape(1, n, -1))
                    continue
                causal = n > 1 and masks[b] is None
                if causal and kb.shape[2] > n:
                    kb, vb = kb[:, :, :n], vb[:, :, :n]
                a = sdpa(q[:, :, lo:hi], kb, vb, attn_mask=masks[b], dropout_p=0.0, scale=scaling,
                         is_causal=causal, **gqa)  # fmt: skip
                outs.append(a.transpose(1, 2).reshape(1, n, -1))
            if kernel is not None:
                a = kernel(q, ks, vs, bounds, scaling)
            else:
                a = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0].contiguous()
            h = residual + lay.o(a)

            residual = h
            x = _rms_norm(h, lay.ln2_w, lay.ln2_eps)
            h = residual + lay.mlp(x, fused, bounds)

        h = _rms_norm(h, self.norm_w, self.norm_eps)
        if keeps is None:
            keeps = [1] * len(tokens)
        if any(not 1 <= k <= n for k, n in zip(keeps, lens, strict=True)):
            raise ValueError(f"lean forward_batch: keeps {keeps} for {lens} new tokens")
        last = torch.tensor(
            [p for e, k in zip(bounds[1:], keeps) for p in range(e - k, e)], device=self.device
        )
        return self.lm_head(h[:, last, :])[0]  # [sum keeps, V]


def _signature(model: torch.nn.Module) -> tuple:
    """What a built lean forward depends on: the attention choice, the module objects and where
    their tensors live (a model moved or cast after the build gets a new lean forward)."""
    tensors = (*model.parameters(), *model.buffers())
    return (
        getattr(model.config, "_attn_implementation", None),
        *map(id, model.modules()),
        *((t.data_ptr(), t.dtype) for t in tensors),
    )


class _Memo:
    """A model's built lean forward; copies and pickles of the model start without one."""

    __slots__ = ("sig", "lean", "why")

    def __init__(self, sig: tuple | None = None, lean: LeanLlama | None = None, why: str = "") -> None:
        self.sig, self.lean, self.why = sig, lean, why

    def __deepcopy__(self, memo: dict) -> _Memo:
        return _Memo()

    def __reduce__(self) -> tuple:
        return (_Memo, ())


def build_lean(model: torch.nn.Module) -> tuple[LeanLlama | None, str]:
    """The lean forward of ``model`` (or None) and a line saying which forward runs and why.

    Built once per model and reused while its modules stay the same (a lean forward holds no
    per-sequence state, so scorers sharing a model share it; fusing twice would copy weights)."""
    memo = getattr(model, "_pipespec_lean", None)
    if memo is not None and memo.sig == _signature(model):
        return memo.lean, memo.why
    reason = unsupported_reason(model)
    if reason is not None:
        lean, why = None, f"transformers forward ({reason})"
    else:
        try:
            lean = LeanLlama(model)
        except Exception as err:  # noqa: BLE001 - anything unexpected: keep the transformers forward
            lean, why = None, f"transformers forward (lean build failed: {type(err).__name__}: {err})"
        else:
            table = "cos/sin table" if lean._table else "cos/sin per forward"
            why = f"lean forward ({lean.n_layers} layers, {lean.fused} fused linears, {table})"
    # A plain attribute (not a submodule), signed after the build: fusing re-points the parts'
    # weights into the fused ones.
    object.__setattr__(model, "_pipespec_lean", _Memo(_signature(model), lean, why))
    return lean, why
