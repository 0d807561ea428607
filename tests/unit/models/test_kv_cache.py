"""The stage's forward pieces against stock transformers: the preallocated KV cache, grouped-query
SDPA without copies, and the flat small-M kernel (row results independent of the row count)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from pipespec_mpi.host.dispatch import supported_isas
from pipespec_mpi.models.cpu.flat_linear import MAX_ROWS, extension, use_flat_linear
from pipespec_mpi.models.fallback import cache_kwarg, use_sdpa_gqa
from pipespec_mpi.models.kv_cache import PreallocatedLayer, preallocated_cache


def small_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=301, hidden_size=72, intermediate_size=100, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


@torch.inference_mode()
def replay(model, cache, steps) -> list[torch.Tensor]:
    """Forwards and rollbacks as a stage does them: ("f", tokens) or ("crop", n)."""
    out = []
    for kind, arg in steps:
        if kind == "f":
            ids = torch.tensor([arg])
            out.append(model(input_ids=ids, logits_to_keep=len(arg), **{cache_kwarg(model): cache}).logits[0])
        else:
            cache.crop(-arg)
    return out


STEPS = [
    ("f", list(range(3, 40))),  # prefill
    ("f", [7]),
    ("f", [8, 9, 10, 11]),  # a proposal under verification
    ("crop", 3),  # two rejected + the token after them
    ("f", [12, 13]),
    ("crop", 1),
    ("f", [14]),
    ("f", [15, 16, 17, 18, 19, 20, 21, 22, 23]),
]


@pytest.mark.parametrize("capacity", [1, 16, 200])  # 1 and 16 force the buffer to grow
def test_preallocated_cache_matches_dynamic_cache(capacity):
    model = small_llama()
    ref = replay(model, DynamicCache(config=model.config), STEPS)
    cache = preallocated_cache(model.config, capacity)
    got = replay(model, cache, STEPS)
    assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)
    assert cache.get_seq_length() == 37 + 1 + 4 - 3 + 2 - 1 + 1 + 9
    assert cache.layers[0].capacity >= cache.get_seq_length()


def test_preallocated_cache_rejects_positive_crop():
    cache = preallocated_cache(small_llama().config, 8)
    with pytest.raises(ValueError, match="negative"):
        cache.layers[0].crop(2)


def test_sdpa_gqa_equals_sdpa_bitwise():
    model = small_llama()
    gqa = copy.deepcopy(model)
    assert use_sdpa_gqa(gqa)
    assert gqa.config._attn_implementation == "sdpa_gqa"
    ref = replay(model, preallocated_cache(model.config, 64), STEPS)
    got = replay(gqa, preallocated_cache(gqa.config, 64), STEPS)
    for a, b in zip(ref, got, strict=True):
        assert torch.equal(a, b)


needs_kernel = pytest.mark.skipif(extension() is None, reason="flat kernel not buildable on this CPU")


@needs_kernel
@pytest.mark.parametrize("isa", supported_isas())  # every build this CPU runs (AVX2 on AVX-512 too)
@pytest.mark.parametrize(("n", "k"), [(49, 72), (50, 100), (7, 13), (64, 16), (130, 1600)])
def test_flat_kernel_rows_do_not_depend_on_row_count(isa, n, k):
    kernel = extension(isa)
    torch.manual_seed(1)
    w, x = torch.randn(n, k), torch.randn(MAX_ROWS, k)
    full = kernel.small_m_linear(x, w)  # [16, n]
    torch.testing.assert_close(full, x @ w.T, rtol=1e-4, atol=1e-4)
    for m in range(1, MAX_ROWS + 1):
        for start in (0, MAX_ROWS - m):
            assert torch.equal(kernel.small_m_linear(x[start : start + m], w), full[start : start + m])


@needs_kernel
def test_flat_model_one_token_steps_equal_verification_rows():
    """A k-token forward's logits equal k one-token steps' in every linear layer's arithmetic; the
    whole model (attention included) agrees to rounding and in its greedy choices."""
    model = small_llama(2)
    assert use_flat_linear(model) == 3 * 7 + 1
    use_sdpa_gqa(model)
    prompt = list(range(5, 30))
    proposal = [40, 41, 42, 43, 44, 45]
    with torch.inference_mode():
        name = cache_kwarg(model)  # the transformers of CI's pin and 5.17 name it differently
        c1 = preallocated_cache(model.config, 64)
        model(input_ids=torch.tensor([prompt]), **{name: c1})
        batch = model(input_ids=torch.tensor([proposal]), logits_to_keep=len(proposal), **{name: c1}).logits[
            0
        ]
        c2 = preallocated_cache(model.config, 64)
        model(input_ids=torch.tensor([prompt]), **{name: c2})
        steps = torch.cat(
            [model(input_ids=torch.tensor([[t]]), **{name: c2}).logits[0, -1:] for t in proposal]
        )
    torch.testing.assert_close(batch, steps, rtol=1e-5, atol=1e-5)
    assert torch.equal(batch.argmax(-1), steps.argmax(-1))
