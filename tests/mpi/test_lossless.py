"""Greedy SD and PipeSpec must reproduce AR token for token, under real mpirun: the case matrix
(tests/mpi/cases.py) of hierarchies, transports, kernels, lookaheads, policies, batch sizes and
CPU dispatch levels, and a few launches of their own (EOS, the RMA window, the Slurm sweep's job).

Each launch runs the methods interleaved in one job (run.mode=benchmark), so every prompt is
decoded by all of them on the same ranks. The tiny hierarchies run in float64, where batched and
one-token forwards agree exactly, so equality is a fair test (see README for bf16/fp32); float32
runs the engine on the CPU kernels (or its portable plug-ins), where a batched row is bitwise its own
forward. Beyond losslessness a case is checked for what its attributes promise (``CHECKS``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from cases import CASES, Case
from conftest import METHODS, assert_all_equal_ar, launch_ok

from pipespec_mpi.records import (
    BENCHMARK,
    RESULTS,
    SUMMARY,
    Record,
    find_entry,
    group_key,
    read_benchmark,
    read_summary,
)

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def check_records_round_trip(case: Case, recs: list[Record], run_dir: Path) -> None:
    """The typed readers hold every field the runner wrote: reading and writing back gives the
    same JSON (results.jsonl, summary.json, benchmark.json)."""
    lines = (run_dir / RESULTS).read_text().splitlines()
    assert [r.to_json() for r in recs] == [json.loads(x) for x in lines if x.strip()]
    for name, read in ((SUMMARY, read_summary), (BENCHMARK, read_benchmark)):
        doc = json.loads((run_dir / name).read_text())
        assert {m: row.to_json() for m, row in read(run_dir / name).items()} == doc, name


def check_benchmark_json(case: Case, recs: list[Record], run_dir: Path) -> None:
    """benchmark.json agrees with the per-prompt records it summarises: one entry per method and
    batch size, its prompts, tokens and wall (batch 1: the records' walls summed; batched: the
    phase, shorter than its sequences' walls summed), speedup over AR at the same batch size."""
    bench = read_benchmark(run_dir / BENCHMARK)
    assert list(bench) == [group_key(m, b) for b in case.sizes for m in case.all_methods]
    for m, b in case.groups:
        row, ar = find_entry(bench, m, b), find_entry(bench, "ar", b)
        rs = [r for r in recs if r.method == m and r.batch_size == b and not r.warmup]
        tokens, wall = sum(len(r.output_ids) for r in rs), sum(r.wall_s for r in rs)
        assert row.n_tokens == tokens and row.n_prompts == len(rs) == case.n_prompts
        assert row.tokens_per_s == pytest.approx(row.n_tokens / row.wall_s)
        if b == 1:
            assert row.ms_per_token == pytest.approx(1000 * wall / tokens)
        else:  # sequences overlapped: the phase took less than their walls summed
            assert row.wall_s < wall
        assert set(row.sequence_ms_per_token) == {"p50", "p90", "mean"}
        assert row.speedup == pytest.approx(ar.ms_per_token / row.ms_per_token)
        assert row.speedup == pytest.approx(row.tokens_per_s / ar.tokens_per_s)
        assert row.speedup_per_prompt.n == case.n_prompts
    assert any(r.warmup for r in recs) == (case.warmup_prompts != 0)  # uncounted warm-ups, per method


def check_slots(case: Case, recs: list[Record], run_dir: Path) -> None:
    """A batch size's slots are all used (the first phase fills them)."""
    slots = {(r.batch_size, r.slot) for r in recs if not r.warmup}
    assert slots == {(b, s) for b in case.sizes for s in range(min(b, case.n_prompts))}


def check_transport(case: Case, recs: list[Record], run_dir: Path) -> None:
    assert all(r.transport == case.transport for r in recs)


def check_full_length(case: Case, recs: list[Record], run_dir: Path) -> None:
    """No EOS on these prompts: every sequence runs to its budget."""
    for r in recs:
        assert len(r.output_ids) == r.n_new_tokens == case.max_new_tokens


def check_verified(case: Case, recs: list[Record], run_dir: Path) -> None:
    """PipeSpec's target accepted proposals at the largest batch size: proposals crossed the links
    and verification happened, batched too."""
    ps = [r for r in recs if r.method == "pipespec" and r.batch_size == max(case.sizes)]
    assert sum(r.stages[-1].tokens_accepted for r in ps) > 0


def check_rollbacks(case: Case, recs: list[Record], run_dir: Path) -> None:
    """The tiny models agree often but not always: rejections and rollbacks occur, and cascade
    through the middle stages. (At lookahead 0 a verifier that never waits can outrun its
    drafters: on a quiet machine the tiny target (~1.6 ms a step) took 64 own steps per prompt
    and every proposal arrived after the rollback that made it stale (seen in CI), so what
    happens beyond losslessness depends on the schedule there; a lookahead makes it wait.)"""
    ps = [r for r in recs if r.method == "pipespec"]
    assert sum(r.stages[-1].rollbacks_signalled for r in ps) > 0
    for stage in range(case.ranks - 1):
        assert sum(r.stages[stage].rollbacks for r in ps) > 0, stage


def check_drafter_counters(case: Case, recs: list[Record], run_dir: Path) -> None:
    """The suffix drafter's own counters reach the records, per source; later prompts draft from
    earlier outputs."""
    drafted = [r.stages[0].drafter for r in recs if r.method != "ar" and not r.warmup]
    keys = {"proposals", "proposed", "accepted", "settled", "misses", "cut", "forgotten"}
    assert all(set(d) == keys for d in drafted)
    assert sum(sum(d["proposals"].values()) for d in drafted) > 0
    assert any("job" in d["proposals"] for d in drafted)


def check_engines(case: Case, recs: list[Record], run_dir: Path) -> None:
    """Every record names each stage's forward and plug-ins: every model stage (all but a
    model-free drafter) ran the engine, with the CPU's plug-ins or, with ``kernels=portable``,
    torch's linears and SDPA over the slots' grid, compiled where the case asks; and what the
    device seam decided for it (``Record.seams``) says the same."""
    for r in recs:
        assert len(r.engines) == case.ranks, r.engines
        assert len(r.seams) == case.ranks and all(t.startswith("cpu node, ") for t in r.seams), r.seams
        for text in r.seams[r.engines[0].startswith("model-free") :]:
            kernels = "portable kernels" if case.kernels == "portable" else "cpu kernels"
            assert text.startswith(f"cpu node, cpu: {kernels}") and f"transport {r.transport}" in text, text
        drafter = r.engines[0].startswith("model-free")  # a drafter is stage 0 or nothing
        if (case.hierarchy or "").endswith("_suffix"):
            assert r.engines[0] == "model-free (SuffixDrafter)"
        for text in r.engines[drafter:]:
            assert text.startswith("engine on cpu"), text
            if case.kernels == "portable":
                assert "linears Linear," in text and "SDPA over the slots' grid" in text, text
                compiled = "device.compile=true" in case.extra
                assert text.endswith(", compiled" if compiled else ", eager"), text
            else:  # the CPU's plug-ins (float32: the kernels' linears where they build)
                assert "SiLU by rows" in text, text
    if "device.compile=true" in case.extra:  # each model stage's graphs made at load
        logs = [(run_dir / f"rank{r}.log").read_text() for r in range(case.ranks)]
        assert all("compiled forward's graphs made in" in log for log in logs), logs


def check_adaptive(case: Case, recs: list[Record], run_dir: Path) -> None:
    """The policy is recorded, with its counters and the cores each stage kept busy; whatever a
    verifier chose, each of its forwards is one of its own steps or a verification. (Which it
    chose follows the measured timings: unit tests of speculative/goodput.py pin those
    decisions with fixed costs.)"""
    assert {r.policy for r in recs} == {"adaptive"}
    summary = json.loads((run_dir / SUMMARY).read_text())
    for stage in summary["pipespec"]["stages"]:
        assert {"waits_chosen", "verify_cut", "drafts_held"} <= set(stage)
        # the cores its rank kept busy: measured for every stage with a part in PipeSpec
        assert 0.0 < stage["cpu_cores"] <= os.cpu_count() + 0.5, stage
    for r in recs:
        if r.method == "pipespec":
            for st in r.stages[1:]:
                assert st.forward_calls == st.draft_steps + st.own_steps + st.verifications, st


def check_matches_generate(case: Case, recs: list[Record], run_dir: Path) -> None:
    """The embedded SmolLM2's AR equals transformers' own greedy generate, with text."""
    from transformers import AutoModelForCausalLM

    from pipespec_mpi.models.smollm2 import ensure_cache

    assert all(len(r.output_ids) > 0 for r in recs)
    model = AutoModelForCausalLM.from_pretrained(ensure_cache(), dtype=torch.float32).eval()
    for r in (r for r in recs if r.method == "ar"):
        ids = torch.tensor([r.prompt_ids])
        with torch.inference_mode():
            out = model.generate(
                ids, max_new_tokens=case.max_new_tokens, do_sample=False, eos_token_id=2, pad_token_id=2
            )
        assert out[0, ids.shape[1] :].tolist() == r.output_ids, r.prompt_id
        assert r.text.strip(), "decoded text is empty"


Check = Callable[[Case, list[Record], Path], None]

# (what a case must be, the check it then gets); every case gets losslessness first
CHECKS: list[tuple[Callable[[Case], bool], Check]] = [
    (lambda c: True, check_records_round_trip),
    (lambda c: True, check_benchmark_json),
    (lambda c: c.batch_sizes is not None, check_slots),
    (lambda c: c.transport is not None, check_transport),
    (lambda c: c.full_length, check_full_length),
    (lambda c: c.verifies, check_verified),
    (lambda c: bool(c.lookahead) and c.policy == "static" and c.batch_sizes is None, check_rollbacks),
    (lambda c: c.hierarchy == "tiny_suffix" and c.policy == "static", check_drafter_counters),
    (lambda c: True, check_engines),
    (lambda c: c.policy == "adaptive", check_adaptive),
    (lambda c: c.hierarchy == "smollm2", check_matches_generate),
]


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=pytest.mark.long if c.tier == "long" else ()) for c in CASES]
)
def test_every_method_equals_ar(tmp_path: Path, case: Case) -> None:
    recs = launch_ok(case.ranks, case.overrides(), tmp_path, timeout=case.timeout, env=dict(case.env))
    assert_all_equal_ar(recs, case.groups)
    for applies, check in CHECKS:
        if applies(case):
            check(case, recs, tmp_path)


def test_eos_stops_early_and_all_methods_agree(tmp_path):
    """Pick a byte the target emits early as EOS; every method must stop at the same place."""
    base = ["hierarchy=tiny", "dataset.n_prompts=3", "decode.max_new_tokens=40"]
    first = launch_ok(3, [*base, "method=ar"], tmp_path / "probe")
    eos = first[0].output_ids[4]
    recs = launch_ok(
        3,
        [*base, "run.mode=benchmark", "decode.lookahead=3", f"hierarchy.tokenizer.eos_token_id={eos}"],
        tmp_path / "eos",
    )
    assert_all_equal_ar(recs, {(m, 1) for m in METHODS})
    stopped = [r for r in recs if r.finish_reason == "eos"]
    assert stopped, "no prompt hit the chosen EOS"
    for r in stopped:
        assert r.output_ids[-1] == eos and eos not in r.output_ids[:-1]
        assert r.n_new_tokens < 40


def test_rma_epochs_window_is_lossless_too(tmp_path):
    """The passive-target RMA window (used when pipelines span nodes) gives the same outputs."""
    recs = launch_ok(
        3,
        ["hierarchy=tiny", "run.mode=benchmark", "run.methods=[ar,sd,pipespec]", "decode.lookahead=2",
         "decode.max_new_tokens=40", "dataset.n_prompts=2", "run.epochs_window=rma", "decode.policy=static"],
        tmp_path,
    )  # fmt: skip
    assert_all_equal_ar(recs, {(m, 1) for m in METHODS})
    assert sum(r.stages[-1].rollbacks_signalled for r in recs if r.method == "pipespec") > 0


@pytest.mark.parametrize(
    "attempt", [0, pytest.param(1, marks=pytest.mark.long), pytest.param(2, marks=pytest.mark.long)]
)
def test_the_slurm_sweep_configuration_never_stalls(tmp_path, attempt):
    """The job that once stalled in the Slurm sweep test (tiny, lookahead 2, max_run_ahead 8, 16
    tokens; the explorer's ``slurm-sweep`` preset), many prompt starts in a row: a stall would end
    the run after run.stall_timeout_s with a StallError."""
    recs = launch_ok(
        3,
        ["hierarchy=tiny", "dataset=synthetic", "dataset.n_prompts=12", "decode.max_new_tokens=16",
         "decode.lookahead=2", "decode.max_run_ahead=8", "run.mode=benchmark", "run.stall_timeout_s=20",
         f"dataset.seed={attempt}", "decode.policy=static"],
        tmp_path,
    )  # fmt: skip
    assert_all_equal_ar(recs, {(m, 1) for m in METHODS})
    assert len(recs) == 3 * 13
