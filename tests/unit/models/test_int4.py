"""Weight-only int4 linears (models/int4.py) and the paper's 70B stage through the engine with them:
random weights of the 70B's proportions at a CI size, on the CPU twin of the GPU's kernel."""

from __future__ import annotations

import pytest
import torch

from pipespec_mpi.config import compose_config
from pipespec_mpi.config.schema import ConfigError
from pipespec_mpi.models.int4 import Int4Linear, dequantized
from pipespec_mpi.models.loader import load_stage
from pipespec_mpi.models.scorer import Engine, EngineScorer, compile_forward
from pipespec_mpi.platforms import CudaPlatform

from .test_engine import alone_and_together, stage_schedule

PROMPT = [(5 * i + 1) % 500 for i in range(30)]
PAPER_70B = [
    "hierarchy=llama3_1b_8b_70b",
    "hierarchy.stages.2.kind=random",
    "hierarchy.stages.2.shape=70B-mini",
    "hierarchy.stages.2.dtype=float32",
]


def test_an_int4_linear_multiplies_by_its_dequantized_weight():
    torch.manual_seed(0)
    w, x = torch.randn(256, 512), torch.randn(5, 512)
    lin = Int4Linear.of(w, group=128)
    got = lin(x)
    assert torch.allclose(got, x @ dequantized(w, 128).t(), atol=1e-4, rtol=1e-5)
    err = (dequantized(w, 128) - w).abs().max()  # half a step of 16 levels over each group's range
    assert 0 < err <= (w.max() - w.min()) / 15 / 2 + 1e-6
    assert lin.packed.numel() * lin.packed.element_size() == w.numel() // 2  # 4 bits a weight


def test_fused_parts_give_each_part_bitwise():
    torch.manual_seed(1)
    parts = [Int4Linear.of(torch.randn(n, 256)) for n in (128, 64, 64)]
    fused = Int4Linear.concat(parts)
    x = torch.randn(7, 256)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


def test_shapes_int4_cannot_take_are_named():
    with pytest.raises(ValueError, match="multiple of the group"):
        Int4Linear.of(torch.randn(64, 96))


@pytest.mark.parametrize("kernels", ["portable", "auto"])
def test_the_paper_70b_stage_runs_int4_in_the_engine_and_batches_its_slots(kernels):
    """llama3_1b_8b_70b's last stage as the yaml has it (int4, one GPU), of the 70B-mini shape:
    the engine runs it (not transformers' forward), its decoder linears int4 and q|k|v fused;
    slots of different lengths verified in one forward give each slot's rows as alone."""
    cfg = compose_config(PAPER_70B)
    stage = cfg.hierarchy.stages[2]
    assert stage.quantization == "int4" and stage.n_gpus == 1
    scorer = load_stage(cfg.hierarchy, 2, [], kernels)
    assert isinstance(scorer, EngineScorer)
    w = scorer.engine.w
    assert type(w.layers[0].qkv.__self__) is Int4Linear and type(w.layers[0].down.__self__) is Int4Linear
    slots = [scorer] + [EngineScorer("s", scorer.engine) for _ in range(2)]
    seqs = [PROMPT[: 10 + 7 * i] for i in range(3)]
    proposals = [[3, 4], [], [5, 6, 7, 8, 9]]
    alone, got = alone_and_together(slots, seqs, proposals, asked=[0, 1, 2], room=16)
    for a, b in zip(alone, got, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.long  # ~4 min on 2 cores (the CPU int4 kernel through the whole schedule, twice)
def test_the_int4_stage_compiles_whole_under_the_jobs_flags():
    """device.compile over a stage's schedule (tests/unit/models/test_engine.py): torch's int4
    kernel is one op to dynamo and inductor, so the forward stays whole (no graph break) in a few
    graphs, with the eager engine's numbers (inductor's own run of it: docs/gpu.md)."""
    from torch._dynamo.utils import counters

    w = load_stage(compose_config(PAPER_70B).hierarchy, 2, [], "portable").engine.w
    torch._dynamo.reset()
    counters.clear()
    eng = Engine(w)
    eng.step, eng.compiled = compile_forward(w, backend="aot_eager"), True  # graphs: any backend's
    compiled = stage_schedule([EngineScorer("c", eng) for _ in range(3)])
    ref = Engine(w)
    eager = stage_schedule([EngineScorer("e", ref) for _ in range(3)])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert 1 <= counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
    for a, b in zip(compiled, eager, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_int4_is_for_a_checkpoints_model():
    with pytest.raises(ConfigError, match="quantization=int4: for a checkpoint's model"):
        compose_config(["hierarchy=tiny", "hierarchy.stages.2.quantization=int4"])
    with pytest.raises(ConfigError, match="int4_group=100"):
        compose_config([*PAPER_70B, "hierarchy.stages.2.int4_group=100"])
    split = compose_config([*PAPER_70B, "hierarchy.stages.2.n_gpus=2"])  # its layers over two GPUs
    assert split.hierarchy.stages[2].n_gpus == 2


def test_bitsandbytes_that_is_not_installed_is_one_message_before_any_model_loads(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    cfg = compose_config(["hierarchy=llama3_1b_8b_70b", "hierarchy.stages.2.quantization=bnb_4bit"])
    (msg,) = CudaPlatform(4, ("a", "b", "c", "d")).problems(cfg, [])
    assert "bitsandbytes" in msg and "quantization=int4" in msg
