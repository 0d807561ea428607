"""The lean Llama forward (models/cpu/lean.py) against the transformers forward it replaces: logits
bitwise equal (torch.equal) through prefill, one-token steps, k-token verifications and rollbacks,
with and without the flat kernel and its fused linears, grouped-query heads, both sdpa flavours,
an int8 dynamic copy; unsupported models keep the transformers forward."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from pipespec_mpi.config import TinyBaseConfig
from pipespec_mpi.models.base import KVScorer, score_batch
from pipespec_mpi.models.cpu import flat_linear
from pipespec_mpi.models.cpu.attention import use_sdpa_gqa
from pipespec_mpi.models.cpu.flat_linear import extension, use_flat_linear
from pipespec_mpi.models.cpu.lean import LeanLlama, _rotate, _signed, build_lean, unsupported_reason
from pipespec_mpi.models.kv_cache import preallocated_cache
from pipespec_mpi.models.tiny import build_tiny

needs_kernel = pytest.mark.skipif(extension() is None, reason="flat kernel not buildable on this CPU")

# GQA in both: 4 heads over 2 KV heads (head_dim 16), 6 over 2 (head_dim 12: vector tails in
# every elementwise op)
BASES = {
    "tiny": TinyBaseConfig(),
    "odd": TinyBaseConfig(hidden_size=72, intermediate_size=100, num_heads=6, num_kv_heads=2, num_layers=3),
}

# ("f", tokens): a forward keeping every position's logits; ("crop", n): roll back n positions
STEPS = [
    ("f", [(7 * i) % 250 for i in range(37)]),  # prefill: > 16 rows, torch's GEMM in FlatLinear
    ("f", [7]),
    ("f", [8]),
    ("f", [9, 10, 11, 12]),  # a proposal under verification
    ("crop", 3),  # rejected tokens rolled back
    ("f", [13, 14]),
    ("crop", 1),
    ("f", [15]),
    *[("f", list(range(20, 20 + k))) for k in range(2, 17)],  # every verification size (2..16)
    ("crop", 12),
    ("f", list(range(40, 57))),  # 17 rows after a cache: mask, torch's GEMM
    ("f", [3]),
]


def model_for(
    base: str | TinyBaseConfig, *, flat: bool, attn: str = "sdpa_gqa", int8: bool = False
) -> LlamaForCausalLM:
    """A tiny random Llama as load_stage prepares it (deterministic: equal builds are equal)."""
    model = build_tiny(BASES[base] if isinstance(base, str) else base, None, 0.0, 0, torch.float32)
    if attn == "sdpa_gqa":
        assert use_sdpa_gqa(model)
    if int8:
        from torch.ao.quantization import quantize_dynamic

        model = quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    if flat:
        assert use_flat_linear(model) > 0
    return model.eval()


@torch.inference_mode()
def run_transformers(model, cache, steps=STEPS) -> list[torch.Tensor]:
    out = []
    for kind, arg in steps:
        if kind == "f":
            ids = torch.tensor([arg])
            out.append(model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=len(arg)).logits)
        else:
            cache.crop(-arg)
    return out


def run_lean(lean: LeanLlama, cache, steps=STEPS) -> list[torch.Tensor]:
    out = []
    for kind, arg in steps:
        if kind == "f":
            out.append(lean.forward(torch.tensor([arg]), cache, len(arg)))
        else:
            cache.crop(-arg)
    return out


def assert_bitwise(ref: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert a.shape == b.shape, i
        assert torch.equal(a, b), f"forward {i}: max |diff| {(a - b).abs().max().item()}"


def lean_for(model) -> LeanLlama:
    lean, why = build_lean(model)
    assert lean is not None, why
    return lean


@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("attn", ["sdpa_gqa", "sdpa"])
@pytest.mark.parametrize("capacity", [8, 200])  # 8 makes the preallocated buffers grow
def test_lean_equals_transformers_torch_linear(base, attn, capacity):
    ref_model = model_for(base, flat=False, attn=attn)
    model = model_for(base, flat=False, attn=attn)
    lean = lean_for(model)
    assert lean.fused == 0 and lean._table
    ref = run_transformers(ref_model, preallocated_cache(ref_model.config, capacity))
    assert_bitwise(ref, run_lean(lean, preallocated_cache(model.config, capacity)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_lean_other_dtypes(dtype):
    """RMSNorm's float32 round trip and the mask in the queries' dtype."""
    ref_model, model = (build_tiny(BASES["odd"], None, 0.0, 0, dtype) for _ in range(2))
    assert use_sdpa_gqa(ref_model) and use_sdpa_gqa(model)
    ref = run_transformers(ref_model, preallocated_cache(ref_model.config, 64))
    assert_bitwise(ref, run_lean(lean_for(model), preallocated_cache(model.config, 64)))


@needs_kernel
@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("fuse", [True, False])
def test_lean_equals_transformers_flat_linear(base, fuse, monkeypatch):
    if not fuse:
        monkeypatch.delattr(flat_linear, "fuse_linears", raising=False)
    ref_model = model_for(base, flat=True)
    model = model_for(base, flat=True)
    lean = lean_for(model)
    n = model.config.num_hidden_layers
    assert lean.fused == (2 * n if fuse and hasattr(flat_linear, "fuse_linears") else 0)
    ref = run_transformers(ref_model, preallocated_cache(ref_model.config, 64))
    assert_bitwise(ref, run_lean(lean, preallocated_cache(model.config, 64)))
    # the model itself (its linears now views of the fused weights) still computes the same
    assert_bitwise(ref, run_transformers(model, preallocated_cache(model.config, 64)))


def make_block_exact(model: torch.nn.Module) -> None:
    """Every linear weight replaced by its Q4_1 blocks dequantised, the output layer's by Q8_0:
    a model as one dequantised from a GGUF (the embedded SmolLM2) holds its weights."""
    from pipespec_mpi.models.cpu.lowbit import dequantize, quantize

    for name, m in model.named_modules():
        if type(m) is torch.nn.Linear:
            fmt = "q8" if name == "lm_head" else "q4"
            with torch.no_grad():
                m.weight.copy_(dequantize(fmt, quantize(m.weight, fmt)))


@needs_kernel
def test_block_exact_weights_are_read_from_their_blocks_bitwise():
    """``use_flat_linear`` finds the exact Q4_1/Q8_0 form of such weights, and the model, fused
    and through the lean forward, computes every step bitwise as the float32 flat kernel does
    (prefill and 17-row forwards on torch's GEMM, 1..16 rows from the blocks)."""
    ref_model, model = model_for("tiny", flat=False), model_for("tiny", flat=False)
    make_block_exact(ref_model)
    make_block_exact(model)
    from pipespec_mpi.models.cpu.lowbit import read_exact_blocks

    n = flat_linear.use_flat_linear(ref_model)
    assert flat_linear.use_flat_linear(model) == n > 0
    assert read_exact_blocks(model) == n  # every layer: q4, and the output layer q8
    flat = [m for m in model.modules() if isinstance(m, flat_linear.FlatLinear)]
    assert {m.blocks.fmt for m in flat} == {"q4", "q8"} and len(flat) == n
    assert model.lm_head.blocks.fmt == "q8"
    lean = lean_for(model)
    assert lean.fused == 2 * model.config.num_hidden_layers
    ref = run_transformers(ref_model, preallocated_cache(ref_model.config, 64))
    assert_bitwise(ref, run_lean(lean, preallocated_cache(model.config, 64)))
    assert read_exact_blocks(model_for("tiny", flat=True)) == 0  # random weights: no block form


def test_lean_int8_dynamic_copy():
    ref_model = model_for("tiny", flat=False, int8=True)
    model = model_for("tiny", flat=False, int8=True)
    assert type(model.model.layers[0].self_attn.q_proj).__module__.startswith("torch.ao.nn.quantized")
    lean = lean_for(model)
    ref = run_transformers(ref_model, preallocated_cache(ref_model.config, 64))
    assert_bitwise(ref, run_lean(lean, preallocated_cache(model.config, 64)))


@pytest.mark.parametrize("fmt", ["bf16", "int8", "q8", "q4"])
def test_lean_lowbit_copies(fmt):
    """Weight-only low-bit linears (models/cpu/lowbit.py), fused where they offer it."""
    lowbit = pytest.importorskip("pipespec_mpi.models.cpu.lowbit")
    ref_model, model = model_for("tiny", flat=False), model_for("tiny", flat=False)
    assert lowbit.use_lowbit_linear(ref_model, fmt) == lowbit.use_lowbit_linear(model, fmt) > 0
    lean = lean_for(model)
    ref = run_transformers(ref_model, preallocated_cache(ref_model.config, 64))
    assert_bitwise(ref, run_lean(lean, preallocated_cache(model.config, 64)))


def test_lean_dynamic_cache_and_rotary_per_forward():
    """transformers' own DynamicLayer cache, and cos/sin from the rotary module at each forward
    (the path taken where the precomputed table would not be bitwise)."""
    ref_model = model_for("odd", flat=False)
    model = model_for("odd", flat=False)
    lean = lean_for(model)
    ref = run_transformers(ref_model, DynamicCache(config=ref_model.config))
    assert_bitwise(ref, run_lean(lean, DynamicCache(config=model.config)))
    lean._table = False
    assert_bitwise(ref, run_lean(lean, preallocated_cache(model.config, 16)))


@pytest.mark.parametrize(("d", "heads", "kv_heads"), [(64, 9, 3), (12, 6, 2), (16, 4, 2)])
@pytest.mark.parametrize("t", [1, 2, 9, 17, 37])
def test_rotate_equals_apply_rotary_pos_emb(d, heads, kv_heads, t):
    """Values and strides (SDPA sees the queries' layout), from separate and from fused outputs."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(t)
    out = torch.randn(1, t, (heads + 2 * kv_heads) * d)  # a fused q|k|v output
    cos, sin = torch.randn(1, t, d), torch.randn(1, t, d)
    q = out[..., : heads * d].contiguous().view(1, t, -1, d).transpose(1, 2)
    k = out[..., heads * d : (heads + kv_heads) * d].contiguous().view(1, t, -1, d).transpose(1, 2)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    fq, fk, _ = out.view(1, t, -1, d).transpose(1, 2).split((heads, kv_heads, kv_heads), 1)
    c, s = cos.unsqueeze(1), _signed(sin).unsqueeze(1)
    for got, ref in ((_rotate(q, c, s), q_ref), (_rotate(fq, c, s), q_ref), (_rotate(fk, c, s), k_ref)):
        assert torch.equal(got, ref) and got.stride() == ref.stride()


def test_lean_comparison_can_fail():
    """The bitwise comparison notices a change in the last bit: one norm's weights, one ulp up."""
    ref_model = model_for("tiny", flat=False)
    model = model_for("tiny", flat=False)
    lean = lean_for(model)
    w = lean.layers[1].ln2_w
    lean.layers[1].ln2_w = torch.nextafter(w.detach(), torch.full_like(w, float("inf")))
    ref = run_transformers(ref_model, preallocated_cache(ref_model.config, 64), STEPS[:2])
    got = run_lean(lean, preallocated_cache(model.config, 64), STEPS[:2])
    assert not all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


@pytest.mark.parametrize("flat", [False, pytest.param(True, marks=needs_kernel)])
def test_kvscorer_lean_equals_transformers_path(flat, caplog):
    """The stage's scorer API (prefill, logits, truncate) with and without the lean forward."""
    with caplog.at_level(logging.INFO, logger="pipespec_mpi"):
        lean = KVScorer("lean", model_for("tiny", flat=flat), torch.device("cpu"))
        plain = KVScorer("plain", model_for("tiny", flat=flat), torch.device("cpu"), lean=False)
    assert lean._lean is not None and plain._lean is None
    assert "lean: lean forward" in caplog.text and "plain: transformers forward (lean=False)" in caplog.text
    seq = [(5 * i + 1) % 250 for i in range(30)]
    for s in (lean, plain):
        s.prefill(seq, room=4)  # small room: the buffers grow during the test
    for proposal, accepted in (([1, 2, 3], 1), ([4], 1), (list(range(50, 66)), 9), ([6, 7], 0)):
        a = lean.logits(seq, proposal)
        b = plain.logits(seq, proposal)
        assert torch.equal(a, b)
        seq = seq + proposal[:accepted] + [int(a[accepted].argmax())]
        for s in (lean, plain):
            s.truncate(len(seq) - 1)


def _scorer(name: str, model: torch.nn.Module, exact: bool, kernel: bool = True) -> KVScorer:
    """A scorer with ``exact_rows``; ``kernel`` False: its rows alone by SDPA, not the row kernel."""
    sc = KVScorer(name, model, torch.device("cpu"), exact_rows=exact)
    sc._lean = copy.copy(sc._lean)
    if not kernel:
        sc._lean.rows_kernel = None
    assert (sc._lean.rows_kernel is not None) == kernel
    return sc


def _one_token_logits(
    base: str, prompt: list[int], tokens: list[int], exact: bool = True, kernel: bool = True
) -> list[torch.Tensor]:
    """The logits a scorer gives each of ``tokens`` fed one at a time after ``prompt`` (AR's
    steps, as the scorer runs them: with ``exact_rows``, the row kernel's attention too)."""
    steps = _scorer("steps", model_for(base, flat=True), exact, kernel)
    steps.prefill(prompt, room=len(tokens) + 2)
    seq, out = list(prompt), []
    for tok in tokens:
        out.append(steps.logits(seq, [])[0])
        seq.append(tok)
    out.append(steps.logits(seq, [])[0])
    return out


@needs_kernel
@pytest.mark.parametrize("kernel", [True, False])
def test_exact_rows_verification_equals_one_token_steps(kernel):
    """With ``exact_rows`` (the last stage's default) a verification of k proposals gives every
    position bitwise the logits one-token steps (AR) give it, for k within the flat kernel's 16
    rows and beyond (17 and 21 rows: split into kernel-sized forwards instead of one torch GEMM),
    by the row kernel and by one SDPA call per row where it does not build; without it SDPA
    rounds some row differently, which is what the option is for. (The "odd"
    model is left out: torch's element-wise ops round the tail of a row that is not a whole
    number of vectors, 72 floats there, differently when another row follows it in memory;
    real models' widths are multiples of 64.)"""
    base = "tiny"
    prompt = [(5 * i + 1) % 250 for i in range(30)]
    differs = 0
    for n in (1, 3, 7, 15, 16, 20):
        proposal = [(11 * i + n) % 250 for i in range(n)]
        for exact in (True, False):
            ref = _one_token_logits(base, prompt, proposal, exact, kernel=kernel and exact)
            wide = _scorer("wide", model_for(base, flat=True), exact, kernel=kernel and exact)
            assert wide._rows == flat_linear.MAX_ROWS
            wide.prefill(prompt, room=n + 2)
            got = wide.logits(prompt, proposal)
            assert got.shape[0] == n + 1 and wide._len == len(prompt) + n
            same = [torch.equal(got[i], ref[i]) for i in range(n + 1)]
            if exact:
                assert all(same), (base, n, same)
            else:
                differs += not all(same)
    assert differs > 0  # the comparison can fail: SDPA over several rows rounds differently
    # without the flat kernel (torch's GEMM, a GPU) rows round differently anyway: one SDPA call
    # per row would buy nothing, so the option is off unless the row kernel runs (then cheaper)
    plain = KVScorer("plain", model_for(base, flat=False), torch.device("cpu"), exact_rows=True)
    assert plain._rows is None and plain.exact_rows == (plain._lean.rows_kernel is not None)


def test_exact_rows_off_without_the_flat_or_the_row_kernel(monkeypatch):
    import pipespec_mpi.models.cpu.lean as lean_module

    monkeypatch.setattr(lean_module, "rows_kernel", lambda isa=None: None)
    plain = KVScorer("plain", model_for("tiny", flat=False), torch.device("cpu"), exact_rows=True)
    assert plain._lean is not None and plain._lean.rows_kernel is None and not plain.exact_rows
    default = KVScorer("default", model_for("tiny", flat=True), torch.device("cpu"), exact_rows=None)
    assert not default.exact_rows  # None: on only where the row kernel runs


@needs_kernel
@pytest.mark.parametrize("kernel", [True, False])
def test_exact_rows_batched_rows_equal_one_token_steps(kernel):
    """``score_batch`` over slots of an exact-rows scorer: each slot's verification rows are
    bitwise its one-token steps, whatever the other slots verify in the same forward (the row
    kernel: all slots in one call per layer)."""
    model = model_for("tiny", flat=True)
    first = _scorer("batched", model, exact=True, kernel=kernel)
    slots = [first] + [first.for_slot() for _ in range(2)]
    prompts = [[(5 * i + b) % 250 for i in range(n)] for b, n in enumerate((9, 23, 14))]
    proposals = [[3, 4, 5], [6], [7, 8, 9, 10, 11]]
    for sc, p, prop in zip(slots, prompts, proposals, strict=True):
        sc.prefill(p, room=len(prop) + 2)
    got = score_batch([(sc, p, prop) for sc, p, prop in zip(slots, prompts, proposals, strict=True)])
    for b, (p, prop) in enumerate(zip(prompts, proposals, strict=True)):
        ref = _one_token_logits("tiny", p, prop, kernel=kernel)
        assert all(torch.equal(got[b][i], ref[i]) for i in range(len(prop) + 1)), b


@pytest.mark.parametrize("flat", [False, pytest.param(True, marks=needs_kernel)])
def test_lean_is_built_once_per_model(flat):
    model = model_for("tiny", flat=flat)
    first, _ = build_lean(model)
    again, _ = build_lean(model)
    assert first is not None and again is first
    model.double()  # moved tensors: a new lean forward, in the new dtype
    third, _ = build_lean(model)
    assert third is not None and third is not first and third.dtype == torch.float64


def test_unsupported_models_keep_transformers_forward(caplog):
    eager = model_for("tiny", flat=False, attn="eager")
    eager.config._attn_implementation = "eager"
    eager.set_attn_implementation("eager")
    assert "attention implementation 'eager'" in unsupported_reason(eager)

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        attn_implementation="sdpa",
    )  # fmt: skip
    dynamic = LlamaForCausalLM(cfg).eval()
    assert "rescales with the sequence length" in unsupported_reason(dynamic)

    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    ).eval()  # fmt: skip
    assert "is not llama" in unsupported_reason(qwen)

    hooked = model_for("tiny", flat=False)
    hooked.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert "hooks" in unsupported_reason(hooked)

    with caplog.at_level(logging.INFO, logger="pipespec_mpi"):
        scorer = KVScorer("q", qwen, torch.device("cpu"))
    assert scorer._lean is None and "q: transformers forward (model_type 'qwen2' is not llama)" in caplog.text
    scorer.prefill([1, 2, 3, 4], room=4)
    assert scorer.logits([1, 2, 3, 4], [5, 6]).shape == (3, 64)


@needs_kernel
@pytest.mark.parametrize("base", list(BASES))
def test_forward_batch_rows_equal_each_sequence_alone(base):
    """B sequences at different positions in one forward (linears over all rows, attention per
    sequence): each row's logits are bitwise those of the sequence's own forward, for one-token
    steps and short verifications (all rows within the flat kernel's 16)."""
    model = model_for(base, flat=True)
    lean, _ = build_lean(model)
    assert lean is not None
    prompts = [[(5 * i + b) % 250 for i in range(n)] for b, n in enumerate((9, 23, 4, 15))]
    solo = [preallocated_cache(model.config, 64) for _ in prompts]
    both = [preallocated_cache(model.config, 64) for _ in prompts]
    for p, c1, c2 in zip(prompts, solo, both, strict=True):
        lean.forward(torch.tensor([p]), c1, 1)
        lean.forward(torch.tensor([p]), c2, 1)
    for step in ([[1], [2], [3], [4]], [[5, 6], [7], [8, 9, 10], [11]], [[12], [13], [14], [15]]):
        batch = lean.forward_batch(step, both)  # [B, V]
        for b, toks in enumerate(step):
            alone = lean.forward(torch.tensor([toks]), solo[b], 1)[0, -1]
            assert torch.equal(batch[b], alone), (base, step, b)
    assert [c.get_seq_length() for c in both] == [c.get_seq_length() for c in solo]
