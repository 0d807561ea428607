"""A stage's decoder layers split over several devices (models/split.py) and the engine's forward
over the split (models/engine.py ``moved``). On a CPU the second device is torch's ``meta``: every
layer, cache and head must sit on its own device and the rows must move on at each boundary, or a
step raises (a GPU run checks the numbers: bench/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from pipespec_mpi.config import TinyBaseConfig
from pipespec_mpi.models import engine as engine_module
from pipespec_mpi.models.engine import Weights, unsupported_reason
from pipespec_mpi.models.scorer import Engine, EngineScorer
from pipespec_mpi.models.split import layer_devices, spread
from pipespec_mpi.models.tiny import build_tiny

CPU, META = torch.device("cpu"), torch.device("meta")


def split_tiny() -> torch.nn.Module:
    model = build_tiny(TinyBaseConfig(num_layers=4), None, 0.0, 0, torch.float32).eval()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as Llama-3.2-1B's is
    return spread(model, [CPU, META])


def test_layers_split_in_contiguous_runs():
    a, b, c = "a", "b", "c"
    assert layer_devices(5, [a, b]) == [a, a, a, b, b]
    assert layer_devices(4, [a, b, c]) == [a, a, b, c]
    assert layer_devices(80, [a, b]) == [a] * 40 + [b] * 40  # Llama-3.1-70B over two GPUs


def test_spread_puts_each_part_on_its_device_and_unties_the_head():
    model = split_tiny()
    inner = model.model
    assert inner.embed_tokens.weight.device == CPU and model.lm_head.weight.device == META
    assert [lay.input_layernorm.weight.device for lay in inner.layers] == [CPU, CPU, META, META]
    assert model.lm_head.weight is not inner.embed_tokens.weight
    assert unsupported_reason(model) is None
    inner.layers[1].mlp.to(META)  # a layer across two devices: the engine cannot run it
    assert unsupported_reason(model) == "decoder layer 1 spans several devices"


def test_the_engine_runs_a_split_stage_moving_only_the_rows():
    w = Weights.of(split_tiny())
    assert w.device == CPU and [lay.ln1.device for lay in w.layers] == [CPU, CPU, META, META]
    scorer = EngineScorer("split", Engine(w))
    scorer.prefill(list(range(1, 20)), room=16)
    assert [kv.k.device for kv in scorer.engine.cache.layers] == [CPU, CPU, META, META]
    logits = scorer.logits(list(range(1, 20)), [3, 4, 5])
    assert logits.shape == (4, w.arch.vocab) and logits.device == META  # the head's device


def test_without_moving_the_rows_a_split_stage_fails(monkeypatch):
    """The test can fail: rows left on the first device meet the second's weights."""
    monkeypatch.setattr(engine_module, "moved", lambda device, *rows: rows)
    scorer = EngineScorer("split", Engine(Weights.of(split_tiny())))
    with pytest.raises((RuntimeError, NotImplementedError)):
        scorer.prefill(list(range(1, 20)), room=16)
