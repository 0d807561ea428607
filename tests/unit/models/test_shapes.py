"""Random-weight models of named shapes (models/shapes.py): the real model's size, the same weights
from the same seed, and a ``random`` stage loaded through the loader as an engine."""

from __future__ import annotations

import pytest
import torch

from pipespec_mpi.config import compose_config
from pipespec_mpi.models.loader import load_stage, stage_tokenizer
from pipespec_mpi.models.shapes import SHAPES, params, random_llama


def test_a_shape_is_its_model_and_a_seed_its_weights():
    a = random_llama("toy", "cpu", torch.bfloat16, seed=3)
    matrices = sum(p.numel() for n, p in a.named_parameters() if not n.endswith("norm.weight"))
    assert matrices == params("toy")  # (params: the matrices a step streams, not the norms)
    assert a.lm_head.weight.dtype == torch.bfloat16 and not a.training
    b, c = (random_llama("toy", "cpu", torch.bfloat16, seed=s) for s in (3, 4))
    assert torch.equal(a.lm_head.weight, b.lm_head.weight) and not torch.equal(
        a.lm_head.weight, c.lm_head.weight
    )
    assert torch.get_default_dtype() == torch.float32  # restored
    with pytest.raises(ValueError, match="unknown model shape '2B'"):
        random_llama("2B", "cpu", torch.float32)
    assert SHAPES["8B"]["num_hidden_layers"] == 32


def test_a_random_stage_is_an_engine_with_the_byte_tokenizer():
    hier = compose_config(["hierarchy=random_toy"]).hierarchy
    scorer = load_stage(hier, 2, cuda_devices=[])
    assert "engine on cpu, float64" in scorer.describe() and scorer.vocab_size == SHAPES["toy"]["vocab_size"]
    assert stage_tokenizer(hier, 2).fingerprint().startswith("bytes-")
    other = load_stage(hier, 1, cuda_devices=[])  # another index: other weights
    scorer.prefill([256, 1, 2], room=4)
    other.prefill([256, 1, 2], room=4)
    assert not torch.equal(scorer.logits([256, 1, 2], []), other.logits([256, 1, 2], []))
