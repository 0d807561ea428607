"""Weight-only low-bit layers: quantisers, the kernels of every ISA build, and whole copies."""

from __future__ import annotations

import copy

import pytest
import torch
from hydra.errors import ConfigCompositionException
from transformers import LlamaConfig, LlamaForCausalLM

from pipespec_mpi.config import ConfigError, compose_config, validate
from pipespec_mpi.host import dispatch
from pipespec_mpi.models.cpu import flat_linear
from pipespec_mpi.models.cpu.lowbit import (
    DENSE_ROWS,
    FORMATS,
    LowBitLinear,
    dense_rows,
    dequantize,
    exact_blocks,
    extension,
    quantize,
    reference_linear,
    use_lowbit_linear,
)

needs_kernel = pytest.mark.skipif(extension() is None, reason="low-bit kernel not buildable on this CPU")


def weights(n: int = 70, k: int = 96, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(n, k) * torch.linspace(0.1, 3.0, k)  # columns of different scales


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantisation_error_is_bounded_by_the_format(fmt):
    w = weights(k=128)
    err = (dequantize(fmt, quantize(w, fmt)) - w).abs()
    if fmt == "bf16":
        assert (err <= w.abs() * 2**-8).all()
    elif fmt in ("int8", "w8a8"):
        assert (err <= w.abs().amax(1, keepdim=True) / 127 / 2 * 1.001).all()
    else:
        blocks = w.reshape(w.shape[0], -1, 32)
        step = (blocks.abs().amax(-1) / 127) if fmt == "q8" else (blocks.amax(-1) - blocks.amin(-1)) / 15
        bound = step.repeat_interleave(32, dim=1) * 0.5 * 1.01 + 1e-3 * w.abs()  # + fp16 scale rounding
        assert (err <= bound).all()


def test_exact_blocks_finds_the_fewest_bytes_format_that_holds_the_weights():
    w = weights(k=128)
    assert exact_blocks(w) is None  # random weights: no block format holds them
    assert exact_blocks(w[:, :100]) is None and exact_blocks(w.double()) is None
    for fmt in ("q8", "q4"):
        found = exact_blocks(dequantize(fmt, quantize(w, fmt)))
        assert found is not None and found[0] == fmt  # Q4_1 weights are not taken for Q8_0's
        assert torch.equal(dequantize(*found), dequantize(fmt, quantize(w, fmt)))
    tail = dequantize("q4", quantize(w, "q4"))
    tail[-1, -1] += 1e-3  # exact in its first row only: the whole weight is checked
    assert exact_blocks(tail) is None


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_blocks_are_recovered_exactly_from_their_dequantised_weights(fmt):
    """A model dequantised from Q8_0/Q4_1 blocks (the embedded SmolLM2 is one) is stored again in
    exactly those blocks: the copy then holds the model's own weights."""
    first = quantize(weights(seed=3), fmt)
    again = quantize(dequantize(fmt, first), fmt)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(dequantize(fmt, again), dequantize(fmt, first))


def test_odd_input_size_is_refused():
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize(torch.randn(4, 96), "w8a8")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), "q4")
    with pytest.raises(ValueError, match="unknown weight format"):
        quantize(torch.randn(4, 32), "q3")


@needs_kernel
@pytest.mark.parametrize("isa", dispatch.supported_isas())
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("n", "k"), [(70, 96), (1, 32), (129, 576), (66, 1536)])
def test_kernel_matches_its_weights_and_rows_are_independent(isa, fmt, n, k):
    if fmt == "w8a8" and k % 64:
        k = 64 * (k // 64 + 1)
    kernel = extension(isa)
    fn = getattr(kernel, f"{fmt}_linear")
    t = quantize(weights(n, k), fmt)
    torch.manual_seed(1)
    x = torch.randn(20, k)  # beyond 16 rows too: the kernel serves prefill
    full = fn(x, *t)
    if fmt == "w8a8":  # integer dot products: the reference is exact, so bitwise
        assert torch.equal(full, reference_linear(fmt, t, x))
    torch.testing.assert_close(full, reference_linear(fmt, t, x), rtol=1e-4, atol=1e-4)
    for m in (1, 2, 5, 16, 20):
        for start in (0, 20 - m):
            assert torch.equal(fn(x[start : start + m], *t), full[start : start + m])
    if fmt not in ("int8", "w8a8"):  # no per-row factor: the float32 kernel's dot products, bitwise
        f32 = flat_linear.extension(isa)
        assert torch.equal(f32.small_m_linear(x[:16], dequantize(fmt, t).contiguous()), full[:16])


def small_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation="sdpa", tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "w8a8"])
def test_copy_computes_with_its_dequantised_weights(fmt):
    model = small_llama()
    low = copy.deepcopy(model)
    assert use_lowbit_linear(low, fmt, dense=0) == 2 * 7 + 1  # the kernel at every row count
    assert isinstance(low.lm_head, LowBitLinear)
    assert low.lm_head.fmt == ("q8" if fmt == "q4" else fmt)  # the output layer keeps 8 bits
    assert low.model.embed_tokens.weight.dtype == torch.float32  # the lookup table is untouched
    ref = copy.deepcopy(model)
    for name, mod in low.named_modules():
        if isinstance(mod, LowBitLinear):
            w = torch.nn.Parameter(dequantize(mod.fmt, mod.tensors), requires_grad=False)
            ref.get_submodule(name).weight = w  # a new tensor: the tied embedding stays float32
    ids = torch.tensor([list(range(5, 40))])
    with torch.inference_mode():
        got, want = low(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_kernel
@pytest.mark.parametrize("fmt", FORMATS)
def test_from_dense_rows_on_a_forward_is_torchs_gemm_and_w8a8_stays_bitwise(fmt):
    """Forwards of ``dense`` rows or more run ``dense_linear``: w8a8 bitwise the kernel's result
    (the same integers and scaling), the others within bfloat16's rounding; fewer rows still run
    the kernel, bitwise."""
    torch.manual_seed(5)
    lin = torch.nn.Linear(128, 70, bias=True)
    kernel_only = LowBitLinear.from_linear(lin, fmt, extension(), dense=0)
    dense = LowBitLinear.from_linear(lin, fmt, extension(), dense=3)
    assert "dense from 3 rows" in repr(dense)
    x = torch.randn(1, 7, 128)
    with torch.inference_mode():
        want, got = kernel_only(x), dense(x)
        assert torch.equal(dense(x[:, :2]), kernel_only(x[:, :2]))
    assert got.shape == want.shape == (1, 7, 70)
    if fmt == "w8a8":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-2 * want.abs().max().item())


def test_dense_rows_are_chosen_by_the_cpus_amx_tiles(monkeypatch):
    from pipespec_mpi.models.cpu import lowbit

    monkeypatch.setattr(lowbit, "cpu_flags", lambda: {"avx512f", "avx512_vnni", "avx512_bf16"})
    assert [dense_rows(f, None) for f in FORMATS] == [0] * len(FORMATS)  # no AMX: the kernel
    monkeypatch.setattr(lowbit, "cpu_flags", lambda: {"amx_bf16"})
    assert dense_rows("int8", None) == DENSE_ROWS["int8"] and dense_rows("w8a8", None) == 0
    monkeypatch.setattr(lowbit, "cpu_flags", lambda: {"amx_int8"})
    assert dense_rows("w8a8", None) == DENSE_ROWS["w8a8"] and dense_rows("q4", None) == 0
    assert dense_rows("w8a8", 0) == 0 and dense_rows("int8", 5) == 5  # a configured count wins


def test_lowbit_copy_config_is_validated():
    with pytest.raises(ConfigError, match=r"stages\[1\] \(smollm2-135m-w8\)\.dense_rows=-1: must be >= 0"):
        compose_config(["hierarchy=smollm2", "hierarchy.stages.1.dense_rows=-1"])
    with pytest.raises(ConfigCompositionException, match="weights=q3"):  # refused by its type
        compose_config(
            ["hierarchy=smollm2", "hierarchy.stages.1.kind=lowbit_copy", "hierarchy.stages.1.weights=q3"]
        )
    cfg = compose_config(["hierarchy=smollm2", "hierarchy.stages.1.kind=lowbit_copy"])
    assert validate(cfg) == []


@needs_kernel
@pytest.mark.parametrize("fmt", ["f32", "f32-blocks", *FORMATS])
def test_fused_layers_compute_their_parts_bitwise(fmt):
    torch.manual_seed(4)
    linears = [torch.nn.Linear(64, n, bias=False) for n in (64, 32, 32)]  # q, k, v
    if fmt == "f32":
        parts = [flat_linear.FlatLinear(lin, flat_linear.extension()) for lin in linears]
    elif fmt == "f32-blocks":  # float32 weights that are exactly Q4_1 blocks, read from them
        parts = []
        for lin in linears:
            with torch.no_grad():
                lin.weight.copy_(dequantize("q4", quantize(lin.weight, "q4")))
            found = exact_blocks(lin.weight)
            assert found is not None and found[0] == "q4"
            blocks = flat_linear.Blocks(*found, extension().q4_linear)
            parts.append(flat_linear.FlatLinear(lin, flat_linear.extension(), blocks))
    else:
        parts = [LowBitLinear.from_linear(lin, fmt, extension()) for lin in linears]
    x = torch.randn(1, 5, 64)
    with torch.inference_mode():
        before = [p(x) for p in parts]
        fused = flat_linear.fuse_linears(parts)
        assert fused is not None
        assert torch.equal(fused(x), torch.cat(before, dim=-1))
        assert all(torch.equal(p(x), b) for p, b in zip(parts, before, strict=True))  # views now
        if fmt == "f32-blocks":
            assert fused.blocks is not None and fused.blocks.fmt == "q4"
            f32 = flat_linear.extension().small_m_linear(x[0], linears[0].weight.detach())
            assert torch.equal(before[0][0], f32)  # the blocks give the float32 kernel's result
    assert flat_linear.fuse_linears([parts[0], linears[1]]) is None  # different kinds


def test_w8a8_copy_keeps_layers_it_cannot_take_and_stays_close():
    model = small_llama()  # intermediate size 96: down_proj's input is not a multiple of 64
    low = copy.deepcopy(model)
    assert use_lowbit_linear(low, "w8a8") == 2 * 6 + 1
    assert type(low.model.layers[0].mlp.down_proj) is torch.nn.Linear
    ids = torch.tensor([list(range(5, 40))])
    with torch.inference_mode():
        got, want = low(input_ids=ids).logits, model(input_ids=ids).logits
    assert (got - want).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize(("fmt", "dense"), [("int8", "null"), ("q4", "null"), ("int8", "3"), ("w8a8", "3")])
def test_loader_builds_a_lowbit_copy_that_tracks_its_source(fmt, dense):
    """kind=lowbit_copy through the loader: a CPU scorer over the source's weights in ``fmt``
    whose greedy choices follow the source's on a prompt, with its layers' ``dense_rows`` as
    configured (prefill and 4-row verifications then run torch's GEMM)."""
    from pipespec_mpi.models.loader import load_stage

    cfg = compose_config(
        ["hierarchy=tiny", "hierarchy.stages.2.dtype=float32", "hierarchy.stages.0.kind=lowbit_copy",
         "hierarchy.stages.0.copy_of=2", f"hierarchy.stages.0.weights={fmt}",
         f"hierarchy.stages.0.dense_rows={dense}"]
    )  # fmt: skip
    copy_, target = load_stage(cfg.hierarchy, 0, []), load_stage(cfg.hierarchy, 2, [])
    layers = [m for m in copy_.engine.w.linears() if isinstance(m, LowBitLinear)]
    assert layers
    want = {dense_rows(m.fmt, None) for m in layers} if dense == "null" else {int(dense)}
    assert {m.dense for m in layers} == want
    prompt = list(range(40, 80))
    for m in (copy_, target):
        m.prefill(prompt, room=8)
    a, b = copy_.logits(prompt, [5, 6, 7]), target.logits(prompt, [5, 6, 7])
    assert a.shape == b.shape
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.5
    torch.testing.assert_close(a, b, rtol=0.1, atol=0.1 * b.abs().max().item())
