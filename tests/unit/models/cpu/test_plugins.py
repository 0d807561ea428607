"""The engine on a CPU with the kernels plugged in (models/cpu/plugins.py), built as a job builds a
stage (models/loader.py ``model_scorer``): every kind of linear (the flat kernel, exact blocks,
low-bit copies, a dynamic int8 copy) computes transformers' numbers through prefill, steps,
verifications and rollbacks; with exact rows a verification of any width and a batched forward
give every row bitwise its one-token step's logits (the row kernel, or one SDPA call per row
where it does not build), which is what keeps greedy PipeSpec equal to AR; the record names the
plug-ins."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipespec_mpi.config import TinyBaseConfig
from pipespec_mpi.models.attention import GridAttention, RowsAloneAttention
from pipespec_mpi.models.cpu import flat_linear
from pipespec_mpi.models.cpu.attention import RowKernelAttention, rows_kernel
from pipespec_mpi.models.engine import Concat, module_of, rope_table, rotate
from pipespec_mpi.models.fallback import TransformersScorer, use_sdpa_gqa
from pipespec_mpi.models.loader import model_scorer
from pipespec_mpi.models.scorer import EngineScorer
from pipespec_mpi.models.tiny import build_tiny
from pipespec_mpi.stage.batch import score_batch

from ..test_engine import PROMPT
from ..test_engine import run_rounds as engine_rounds

needs_kernel = pytest.mark.skipif(flat_linear.extension() is None, reason="flat kernel not buildable here")
needs_rows = pytest.mark.skipif(rows_kernel() is None, reason="row kernel not buildable here")

# GQA in both: 4 heads over 2 KV heads (head_dim 16), 6 over 2 (head_dim 12: vector tails)
BASES = {
    "tiny": TinyBaseConfig(),
    "odd": TinyBaseConfig(hidden_size=72, intermediate_size=100, num_heads=6, num_kv_heads=2, num_layers=3),
}
# (proposal, how many of it to keep): steps, verifications of every kind (17 and 20 rows: pieces
# of the flat kernel's 16), rollbacks between
ROUNDS = [([1, 2, 3], 1), ([], 0), (list(range(40, 56)), 9), ([4, 5, 6, 7, 8], 3), ([9], 0),
          (list(range(60, 77)), 2), (list(range(80, 100)), 20), ([], 0)]  # fmt: skip


def model_for(base: str | TinyBaseConfig = "tiny", *, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A tiny random Llama (deterministic: equal builds are equal)."""
    return build_tiny(BASES[base] if isinstance(base, str) else base, None, 0.0, 0, dtype).eval()


def engine_for(model: torch.nn.Module, exact_rows: bool | None = True, **kw) -> EngineScorer:
    sc = model_scorer("s", model, exact_rows=exact_rows, **kw)
    assert isinstance(sc, EngineScorer)
    return sc


def run_rounds(scorer, rounds=ROUNDS) -> list[torch.Tensor]:
    """test_engine's rounds over this file's, with a small room: the cache grows during the run."""
    return engine_rounds(scorer, rounds, room=8)


def reference(model: torch.nn.Module) -> list[torch.Tensor]:
    use_sdpa_gqa(model)
    return run_rounds(TransformersScorer("ref", model, torch.device("cpu")))


def assert_close(ref: list[torch.Tensor], got: list[torch.Tensor], tol: float = 1e-4) -> None:
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert a.shape == b.shape, i
        assert torch.allclose(a, b, atol=tol, rtol=tol), (i, (a - b).abs().max().item())


# ---- every kind of linear computes transformers' numbers -------------------------------------


@needs_kernel
@pytest.mark.parametrize("base", list(BASES))
@pytest.mark.parametrize("exact", [True, False])
def test_the_flat_kernel_engine_computes_transformers_numbers(base, exact):
    sc = engine_for(model_for(base), exact_rows=exact)
    assert {type(m).__name__ for m in sc.engine.w.linears()} == {"FlatLinear"}
    assert sc.engine.max_rows == (flat_linear.MAX_ROWS if exact else None)
    assert_close(reference(model_for(base)), run_rounds(sc))


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
    """Weights with an exact Q4_1/Q8_0 form are read as blocks, fused q|k|v and gate|up too, and
    every logit is bitwise what the float32 flat kernel computes from the same weights."""
    floats, blocks = model_for(), model_for()
    make_block_exact(floats)
    make_block_exact(blocks)
    ref = engine_for(floats, exact_blocks=False)
    got = engine_for(blocks)
    kinds = {f"{type(m).__name__}[{m.blocks.fmt}]" for m in got.engine.w.linears()}
    assert kinds == {"FlatLinear[q4]", "FlatLinear[q8]"} and module_of(got.engine.w.head).blocks.fmt == "q8"
    assert "FlatLinear[q4]+FlatLinear[q8]" in got.describe()
    for i, (a, b) in enumerate(zip(run_rounds(ref), run_rounds(got), strict=True)):
        assert torch.equal(a, b), i


def test_a_dynamic_int8_copy_runs_on_the_engine():
    from torch.ao.quantization import quantize_dynamic

    def int8() -> torch.nn.Module:
        return quantize_dynamic(model_for(), {torch.nn.Linear}, dtype=torch.qint8)

    sc = engine_for(int8())
    assert isinstance(module_of(sc.engine.w.layers[0].qkv), Concat)  # they do not fuse: called side by side
    assert "linears quantized.dynamic.Linear" in sc.describe()
    assert_close(reference(int8()), run_rounds(sc), tol=1e-3)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "q8", "q4"])
def test_lowbit_copies_run_on_the_engine_fused(fmt):
    from pipespec_mpi.models.cpu import lowbit

    ref_model, model = model_for(), model_for()
    assert lowbit.use_lowbit_linear(ref_model, fmt) == lowbit.use_lowbit_linear(model, fmt) > 0
    sc = engine_for(model)
    assert all(type(m).__name__ == "LowBitLinear" for m in sc.engine.w.linears())
    assert_close(reference(ref_model), run_rounds(sc), tol=1e-3)


def test_other_dtypes_run_on_the_engine():
    """float64 and bfloat16: no flat kernel, no row kernel; exact rows by SDPA one row at a time
    where a linear promises row-exactness, else the grid."""
    for dtype, tol in ((torch.float64, 1e-10), (torch.bfloat16, 0.1)):
        sc = engine_for(model_for("odd", dtype=dtype))
        assert isinstance(sc.engine.w.attention, GridAttention) and not sc.thread_invariant
        got = run_rounds(sc)
        ref = reference(model_for("odd", dtype=dtype))
        assert_close([r.float() for r in ref], got, tol)


def test_a_model_the_engine_cannot_run_keeps_transformers_forward_and_says_what_it_loses(caplog):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    ).eval()  # fmt: skip
    with caplog.at_level(logging.INFO, logger="pipespec_mpi"):
        sc = model_scorer("q", qwen)
    assert isinstance(sc, TransformersScorer) and not sc.batchable
    assert (
        "q: transformers forward, the engine cannot run it (model_type 'qwen2' is not llama)" in caplog.text
    )
    assert "no batched slots" in caplog.text
    sc.prefill([1, 2, 3, 4], room=4)
    assert sc.logits([1, 2, 3, 4], [5, 6]).shape == (3, 64)

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )  # fmt: skip
    assert isinstance(model_scorer("d", LlamaForCausalLM(cfg).eval()), TransformersScorer)


# ---- exact rows: a verification's rows are its one-token steps, bitwise ---------------------


def _steps(model: torch.nn.Module, prompt: list[int], tokens: list[int], **kw) -> list[torch.Tensor]:
    """The logits a scorer gives each of ``tokens`` fed one at a time after ``prompt`` (AR)."""
    steps = engine_for(model, **kw)
    steps.prefill(prompt, room=len(tokens) + 2)
    seq, out = list(prompt), []
    for tok in tokens:
        out.append(steps.logits(seq, [])[0])
        seq.append(tok)
    out.append(steps.logits(seq, [])[0])
    return out


def _no_row_kernel(monkeypatch) -> None:
    from pipespec_mpi.models.cpu import plugins

    monkeypatch.setattr(plugins, "rows_kernel", lambda isa=None: None)


@needs_kernel
@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_rows), False])
def test_exact_rows_verification_equals_one_token_steps(kernel, monkeypatch):
    """With exact rows (the last stage's default) a verification of k proposals gives every
    position bitwise the logits one-token steps (AR) give it, for k within the flat kernel's 16
    rows and beyond (17 and 21 rows: pieces of at most 16), by the row kernel and by one SDPA call
    per row where it does not build; without exact rows SDPA over the grid rounds some row
    differently, which is what the option is for."""
    if not kernel:
        _no_row_kernel(monkeypatch)
    differs = 0
    for n in (1, 3, 7, 15, 16, 20):
        proposal = [(11 * i + n) % 250 for i in range(n)]
        for exact in (True, False):
            ref = _steps(model_for(), PROMPT, proposal, exact_rows=exact)
            wide = engine_for(model_for(), exact_rows=exact)
            want = RowKernelAttention if kernel else RowsAloneAttention
            assert isinstance(wide.engine.w.attention, want if exact else GridAttention)
            wide.prefill(PROMPT, room=n + 2)
            got = wide.logits(PROMPT, proposal)
            assert got.shape[0] == n + 1 and wide.length == len(PROMPT) + n
            same = [torch.equal(got[i], ref[i]) for i in range(n + 1)]
            if exact:
                assert all(same), (n, same)
            else:
                differs += not all(same)
    assert differs > 0  # the comparison can fail: SDPA over several rows rounds differently


def test_exact_rows_need_a_row_exact_part(monkeypatch):
    """Without the row kernel and without a row-exact linear (torch's GEMM) one SDPA call per row
    would buy nothing: the grid runs; None means exact where the row kernel runs."""
    _no_row_kernel(monkeypatch)
    plain = engine_for(model_for(), flat_linear=False)
    assert isinstance(plain.engine.w.attention, GridAttention) and plain.engine.max_rows is None
    default = engine_for(model_for(), exact_rows=None)
    assert isinstance(default.engine.w.attention, GridAttention)


@needs_kernel
@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_rows), False])
def test_batched_rows_equal_one_token_steps(kernel, monkeypatch):
    """Slots of one engine through ``score_batch``: each slot's verification rows are bitwise its
    one-token steps, whatever the other slots verify in the same forward (packed in forwards of
    at most 16 rows, a slot over 16 in pieces)."""
    if not kernel:
        _no_row_kernel(monkeypatch)
    first = engine_for(model_for())
    slots = [first] + [first.for_slot() for _ in range(3)]
    prompts = [[(5 * i + b) % 250 for i in range(n)] for b, n in enumerate((9, 23, 14, 11))]
    proposals = [[3, 4, 5], [6], [7, 8, 9, 10, 11], list(range(20, 38))]
    for sc, p, prop in zip(slots, prompts, proposals, strict=True):
        sc.prefill(p, room=len(prop) + 2)
    got = score_batch([(sc, p, prop) for sc, p, prop in zip(slots, prompts, proposals, strict=True)])
    for b, (p, prop) in enumerate(zip(prompts, proposals, strict=True)):
        ref = _steps(model_for(), p, prop)
        assert all(torch.equal(got[b][i], ref[i]) for i in range(len(prop) + 1)), b
    assert [sc.length for sc in slots] == [len(p) + len(q) for p, q in zip(prompts, proposals, strict=True)]


@needs_kernel
@needs_rows
def test_the_comparison_can_fail():
    """The bitwise comparison notices a change in the last bit: one norm's weights, one ulp up."""
    ref = _steps(model_for(), PROMPT, [1, 2])
    sc = engine_for(model_for())
    lay = sc.engine.w.layers[1]
    bumped = torch.nextafter(lay.ln2, torch.full_like(lay.ln2, float("inf")))
    sc.engine.w.layers[1] = lay._replace(ln2=bumped)
    sc.prefill(PROMPT, room=4)
    got = sc.logits(PROMPT, [1, 2])
    assert not all(torch.equal(got[i], ref[i]) for i in range(3))


# ---- the parts -------------------------------------------------------------------------------


@pytest.mark.parametrize(("d", "heads", "kv_heads"), [(64, 9, 3), (12, 6, 2), (16, 4, 2)])
@pytest.mark.parametrize("t", [1, 2, 9, 17, 37])
def test_rotate_equals_apply_rotary_pos_emb(d, heads, kv_heads, t):
    """``rotate`` with the signed sin table is transformers' RoPE bitwise."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    base = TinyBaseConfig(hidden_size=d * heads, intermediate_size=64, num_heads=heads, num_kv_heads=kv_heads)
    model = model_for(base)
    from pipespec_mpi.models.engine import Weights

    w = Weights.of(model)
    cos_t, sin_t = rope_table(w, 64)
    pos = torch.arange(5, 5 + t)
    cos, sin = model.model.rotary_emb(torch.empty(0), pos[None])
    g = torch.Generator().manual_seed(t)
    q = torch.randn(1, heads, t, d, generator=g)
    k = torch.randn(1, kv_heads, t, d, generator=g)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    c, s = cos_t[pos][:, None, :], sin_t[pos][:, None, :]
    assert torch.equal(rotate(q[0].transpose(0, 1), c, s), want_q[0].transpose(0, 1))
    assert torch.equal(rotate(k[0].transpose(0, 1), c, s), want_k[0].transpose(0, 1))


@needs_kernel
@needs_rows
def test_the_scorer_says_what_it_runs_and_whether_threads_matter():
    sc = engine_for(model_for())
    assert sc.thread_invariant
    text = sc.describe()
    assert "linears FlatLinear" in text and "attention row kernel" in text and "16 rows a forward" in text
    portable = engine_for(model_for(), kernels="portable")
    assert not portable.thread_invariant and "attention SDPA over the slots' grid" in portable.describe()
    assert {type(m).__name__ for m in portable.engine.w.linears()} == {"Linear"}


def test_device_compile_runs_the_kernels_eager_and_says_so(caplog):
    """The CPU kernels are extensions dynamo cannot trace whole: such a stage runs eager, logged;
    the portable plug-ins compile."""
    assert "attention row kernel" in engine_for(model_for()).engine.w.uncompilable()
    assert engine_for(model_for(), kernels="portable").engine.w.uncompilable() is None
    with caplog.at_level("WARNING"):
        sc = model_scorer("t", model_for(), kernels="auto", exact_rows=None, compiled=True, flat_linear=True,
                          exact_blocks=False)  # fmt: skip
    assert not sc.engine.compiled and "device.compile: the forward runs eager" in caplog.text
