"""The engine (models/engine.py, models/scorer.py) with its portable plug-ins (torch's linears, SDPA
over the slots' grid): transformers' Llama numbers through prefill, steps, verifications,
rollbacks and batched slots; device-clean on torch's ``meta`` device (a tensor made off the
engine's device, or a host sync, raises there); and its decode and verify steps compile whole
(``fullgraph=True``). The CPU plug-ins: tests/unit/models/cpu/test_plugins.py."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from transformers import LlamaConfig, LlamaForCausalLM

from pipespec_mpi.config import TinyBaseConfig
from pipespec_mpi.models import engine as engine_module
from pipespec_mpi.models.engine import Weights, unsupported_reason
from pipespec_mpi.models.fallback import TransformersScorer
from pipespec_mpi.models.rows import Batch
from pipespec_mpi.models.scorer import Engine, EngineScorer, Request, compile_forward
from pipespec_mpi.models.tiny import build_tiny
from pipespec_mpi.speculative.greedy import accept

PROMPT = [(5 * i + 1) % 250 for i in range(30)]
# (proposal, how many of it to keep): steps, verifications of every kind, rollbacks between
ROUNDS = [([1, 2, 3], 1), ([], 0), (list(range(40, 56)), 9), ([4, 5, 6, 7, 8], 3), ([9], 0), ([], 0)]


def tiny(dtype: torch.dtype, base: TinyBaseConfig | None = None) -> LlamaForCausalLM:
    return build_tiny(base or TinyBaseConfig(), None, 0.0, 0, dtype).eval()


def run_rounds(scorer, rounds=ROUNDS, room: int = 48) -> list[torch.Tensor]:
    """The logits a scorer gives through a prefill of PROMPT (``room`` positions beyond it) and
    ``rounds`` (each verdict committed as a verifier would, the rest rolled back)."""
    scorer.prefill(PROMPT, room=room)
    seq, out = list(PROMPT), []
    for proposal, kept in rounds:
        logits = scorer.logits(seq, proposal)
        out.append(logits)
        seq = seq + proposal[:kept] + [int(logits[kept].argmax())]
        scorer.truncate(len(seq) - 1)
    return out


@pytest.mark.parametrize(
    "base", [TinyBaseConfig(), TinyBaseConfig(num_heads=4, num_kv_heads=4, num_layers=2)]
)
def test_engine_equals_transformers_in_float64(base):
    """Bitwise, in float64 (where batched and one-token forwards round alike)."""
    ref = run_rounds(TransformersScorer("ref", tiny(torch.float64, base), torch.device("cpu")))
    got = run_rounds(EngineScorer("engine", Engine(Weights.of(tiny(torch.float64, base)))))
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert torch.equal(a, b), (i, (a - b).abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_close_to_transformers_in_lower_precision(dtype):
    ref = run_rounds(TransformersScorer("ref", tiny(dtype), torch.device("cpu")))
    got = run_rounds(EngineScorer("engine", Engine(Weights.of(tiny(dtype)))))
    tol = 1e-4 if dtype == torch.float32 else 0.1
    for a, b in zip(ref, got, strict=True):
        assert torch.allclose(a.float(), b, atol=tol, rtol=tol)


def test_a_half_precision_head_gives_float32_logits_not_rounded_to_half():
    """The LM head of a bf16 model computes in float32 (``Float32Head``): its logits carry more
    than bf16's bits, so near-ties are not made exact ties by rounding."""
    model = tiny(torch.bfloat16)
    head = Weights.of(model).head
    x = torch.randn(5, model.config.hidden_size).bfloat16()
    got = head(x)
    assert got.dtype == torch.float32
    assert torch.allclose(got, x.float() @ model.lm_head.weight.float().t(), rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, got.bfloat16().float())


def alone_and_together(slots, seqs, proposals, asked, room: int):
    """Each slot's logits of its proposal in a forward of its own (rolled back after), then those
    of the ``asked`` slots in one ``score_many``."""
    for sc, seq in zip(slots, seqs, strict=True):
        sc.prefill(seq, room=room)
    alone = []
    for sc, seq, prop in zip(slots, seqs, proposals, strict=True):
        alone.append(sc.logits(seq, prop))
        sc.truncate(len(seq) - 1)
    return alone, slots[0].score_many([(slots[i], seqs[i], proposals[i]) for i in asked])


def test_slots_in_one_forward_equal_each_alone():
    """Slots of different lengths, verifying different counts in one padded forward, give each
    slot's rows as its own forward does (float64: bitwise); a slot not asked for is untouched."""
    engine = Engine(Weights.of(tiny(torch.float64)))
    slots = [EngineScorer("s", engine) for _ in range(4)]
    seqs = [PROMPT[: 8 + 6 * i] for i in range(4)]
    proposals = [[], [3, 4], [5, 6, 7, 8], list(range(10, 26))]
    asked = [0, 1, 3]  # slot 2 sits this forward out
    alone, got = alone_and_together(slots, seqs, proposals, asked, room=24)
    for i, rows in zip(asked, got, strict=True):
        assert torch.equal(rows, alone[i]), i
    want = [len(s) + len(p) if i in asked else len(s) - 1 for i, (s, p) in enumerate(zip(seqs, proposals))]
    assert [sc.length for sc in slots] == want  # the cache holds seq + proposal


def test_unsupported_models_are_named():
    model = tiny(torch.float32)
    assert unsupported_reason(model) is None
    model.config.mlp_bias = True
    assert "bias" in unsupported_reason(model)


# ---- device-clean: every step on torch's meta device ----------------------------------------


def meta_engine(slots: int = 3) -> Engine:
    """An engine whose weights, cache and tables live on ``meta`` (a Llama-3-shaped config:
    grouped heads, llama3 rope scaling)."""
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    eng = Engine(Weights.of(model))
    assert eng.w.device.type == "meta" and eng.cache.k[0].device.type == "meta"
    for _ in range(slots):
        eng.new_slot()
    return eng


def test_every_step_runs_on_meta():
    """Prefill, one-token steps of every slot, a B-slot verification, a rollback and the verdicts:
    each runs with every tensor on ``meta``, so none is made off the device and none is read on
    the host (both raise there)."""
    eng = meta_engine()
    for s in range(3):
        eng.begin(s, 64)
        (logits,) = eng.run([Request(s, list(range(20 + s)), 1)])  # prefill
        assert logits.shape == (1, 512) and logits.device.type == "meta"
        assert logits.dtype == torch.float32  # a bf16 model's head: float32 out of the matmul
    steps = eng.run([Request(s, [7], 1) for s in range(3)])  # decode: every slot, one row
    verify = eng.run(
        [Request(0, [1, 2, 3], 3), Request(2, [4, 5, 6, 7, 8], 5)]
    )  # B-slot verification, padded
    assert [t.shape for t in steps] == [(1, 512)] * 3 and [t.shape for t in verify] == [(3, 512), (5, 512)]
    eng.lengths[2] -= 3  # a rollback: the host's length, nothing on the device
    proposal = torch.tensor([[2, 3, 0, 0], [5, 6, 7, 8]], device="meta")
    target = torch.stack([torch.cat([verify[0], verify[0][:2]]), verify[1]]).argmax(-1)
    verdict = accept(proposal, torch.tensor([2, 4], device="meta"), target)
    assert verdict.shape == (2, 2) and verdict.device.type == "meta"


def test_meta_catches_a_hidden_cpu_tensor(monkeypatch):
    """The test can fail: a tensor created without the engine's device raises on ``meta``."""
    real = engine_module.rotate

    def leaky(x, cos, sin):
        return real(x, cos, sin) + torch.zeros(x.shape[-1])  # on the CPU

    monkeypatch.setattr(engine_module, "rotate", leaky)
    eng = meta_engine(1)
    eng.begin(0, 16)
    with pytest.raises(RuntimeError, match="device"):
        eng.run([Request(0, [1, 2, 3], 3)])


def test_meta_catches_a_host_sync():
    """The test can fail: reading a tensor on the host (``.item()``, ``.tolist()``, ``bool``)
    raises on ``meta``, where on CUDA it would stall the stream."""
    eng = meta_engine(1)
    eng.begin(0, 16)
    (logits,) = eng.run([Request(0, [1, 2], 2)])
    for read in (lambda t: t.argmax().item(), lambda t: t.argmax(-1).tolist(), lambda t: bool((t > 0).any())):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read(logits)


# ---- compiled whole: no graph break in the decode and verify steps ----------------------------


def grid(tokens: list[list[int]], start: list[int], capacity: int) -> Batch:
    """The grid batch of slots 0..S-1, each with its tokens (padded to the widest) from ``start``."""
    width = max(map(len, tokens))
    rows = [(s, j, j < len(tokens[s])) for s in range(len(tokens)) for j in range(width)]
    return Batch.of(
        torch.device("cpu"),
        tokens=[tokens[s][j] if ok else 0 for s, j, ok in rows],
        pos=[start[s] + j if ok else 0 for s, j, ok in rows],
        slot=[s for s, _, _ in rows],
        write=[start[s] + j if ok else capacity - 1 for s, j, ok in rows],
        keep=list(range(len(rows))), grid_slots=slice(0, len(tokens)), width=width, span=capacity - 1,
    )  # fmt: skip


def one_layer(dtype: torch.dtype) -> LlamaForCausalLM:
    """The tiny model cut to its first layer (what compiles is the same, in less time)."""
    model = tiny(dtype)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    return model


def stage_schedule(slots: list[EngineScorer]) -> list[torch.Tensor]:
    """What a stage asks of its engine: prompts of many lengths (the cache growing), one-token
    steps, verifications of 1..16 proposals, one slot, some and all slots together, a catch-up of
    several tokens after a rollback."""
    out = []
    for rnd, plen in enumerate([5, 30, 70]):
        seqs = [[(3 * j + i + rnd) % 200 for j in range(plen + i)] for i in range(len(slots))]
        for s, seq in zip(slots, seqs, strict=True):
            s.prefill(seq, room=20)
        for k in (0, 1, 3, 8, 16):
            asks = [(s, seqs[i], list(range(k))) for i, s in enumerate(slots)]
            for group in ([asks[k % len(slots)]], asks[1:], asks):
                out += slots[0].score_many(group)
                for s, seq, _ in group:  # a rollback: the next request catches up 1 to 3 tokens
                    s.truncate(len(seq) - 1 - (k % 3))
    return out


@pytest.mark.slow
def test_the_compiled_step_is_one_graph_per_few_shapes_under_the_jobs_flags():
    """``device.compile`` as a job runs it (``compile_forward``: the layer fullgraph, dynamic
    shapes) over a stage's schedule on a model of several layers: every graph made by the
    warm-up at load, no graph break, no recompile past dynamo's limit (each would raise under
    ``fullgraph``), at most 4 graphs for all layers (one compile serves every layer), and the
    eager engine's numbers. Graphs are counted on the aot_eager backend (what dynamo captures
    does not depend on the backend)."""
    torch._dynamo.reset()
    counters.clear()
    model = tiny(torch.float64)
    assert model.config.num_hidden_layers >= 3
    w = Weights.of(model)
    attentions = []  # per graph, its attention calls (read before aot_eager consumes the graph)

    def recorded(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        names = [getattr(n.target, "__name__", "") for n in gm.graph.nodes]
        attentions.append(names.count("scaled_dot_product_attention"))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    eng = Engine(w)
    eng.step, eng.compiled = compile_forward(w, backend=recorded), True
    slots = [EngineScorer("c", eng) for _ in range(3)]
    assert slots[0].warm_up(3) > 0 and eng.lengths == [0, 0, 0]
    warmed = counters["stats"]["unique_graphs"]
    compiled = stage_schedule(slots)
    assert counters["stats"]["unique_graphs"] == warmed  # the warm-up made every graph it needs
    ref_eng = Engine(w)
    eager = stage_schedule([EngineScorer("e", ref_eng) for _ in range(3)])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert 1 <= counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
    assert set(attentions) == {1}, attentions  # each graph one layer's (the whole forward: 3)
    for a, b in zip(compiled, eager, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)
    verdicts = torch.compile(accept, fullgraph=True, dynamic=True, backend="aot_eager")
    padded = torch.tensor([[1, 5, 6, 7], [2, 8, 0, 0], [3, 9, 9, 0]])
    assert verdicts(padded[:, 1:], torch.tensor([3, 1, 2]), torch.randn(3, 4, 9).argmax(-1)).shape == (3, 2)


@pytest.mark.slow
def test_inductor_writes_the_cache_in_place():
    """Inductor's code for a compiled step passes each layer's key and value buffers to the kernel
    that writes the new rows as outputs (written in place, no copy of the cache in or out), and
    its logits are the eager engine's."""
    torch._dynamo.reset()
    w = Weights.of(one_layer(torch.float32))
    got = {}
    for mode in ("eager", "compiled"):
        eng = Engine(w, compiled=mode == "compiled")
        a, b = EngineScorer("c", eng), EngineScorer("c", eng)
        a.prefill(PROMPT, room=8)
        b.prefill(PROMPT[:20], room=8)
        got[mode], codes = run_and_get_code(a.score_many, [(a, PROMPT, [3, 4]), (b, PROMPT[:20], [5])])
    for x, y in zip(got["eager"], got["compiled"], strict=True):
        assert torch.allclose(x, y, rtol=0, atol=1e-4)
    (code,) = codes
    call = code[code.index("def call(") :]
    assert "copy_(" not in call and "aten.index_put" not in call and "scatter" not in call
    inputs = {m for m in re.findall(r"\b(arg\d+_1)\b", call)}
    caches = {
        n for n in inputs if re.search(rf"assert_size_stride\({n}, \([^()]*,[^()]*,[^()]*,[^()]*\)", call)
    }
    assert len(caches) == 2, caches  # the layer's k and v buffers [S, kv_heads, C, D]
    written = set()
    for kernel, args in re.findall(r"(cpp_fused_\w*index_put\w*)\(([^)]*)\)", call):
        types = re.search(rf"{kernel} = async_compile.cpp_pybinding\(\[([^\]]*)\]", code).group(1)
        for t, arg in zip(types.split(", "), args.split(", "), strict=False):
            if arg in caches and "const" not in t:
                written.add(arg)
    assert written == caches, (written, caches)


@pytest.mark.long
def test_the_compiled_engine_computes_what_the_eager_one_does():
    """``device.compile`` (inductor): the same scorer API, the same numbers as eager."""
    torch._dynamo.reset()
    w = Weights.of(one_layer(torch.float64))
    ref = run_rounds(EngineScorer("eager", Engine(w)))
    got = run_rounds(EngineScorer("compiled", Engine(w, compiled=True)))
    for a, b in zip(ref, got, strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
