"""hierarchy=auto's choice on synthetic measurements (pure: no process, no model): the planner's
search over a ``MeasuredSource`` with ``AUTO_GRID``, as plan/job.py ``choose`` runs it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipespec_mpi.auto.fingerprint import MeasurementCache, cpu_identity
from pipespec_mpi.auto.measure import Agreement, StageCost, disagreeing
from pipespec_mpi.auto.measured import (
    Measured,
    agreement_rate,
    candidates,
    lookup_rates,
    run_trace,
    stage_shares,
)
from pipespec_mpi.config import DecodeConfig, StageConfig, compose_config
from pipespec_mpi.host.placement import CpuShare
from pipespec_mpi.plan.options import AUTO_GRID, Option, Plan
from pipespec_mpi.plan.realize import realize
from pipespec_mpi.plan.search import search
from pipespec_mpi.plan.sources import MeasuredSource


def predict(m, decode, max_stages, margin, seeds=(0,), batch_sizes=(1,)):
    grid = replace(AUTO_GRID, batch_sizes=batch_sizes)
    return search(MeasuredSource(m, seeds), decode, grid, max_stages, margin)


STAGES = (
    StageConfig("lookup", "prompt_lookup"),
    StageConfig("int8", "int8_copy", copy_of=3),
    StageConfig("small", "tiny"),
    StageConfig("target", "tiny"),
)


def test_candidates_end_with_the_target_keep_lookup_first_and_copies_with_their_source():
    got = candidates(STAGES, max_stages=3)
    assert all(p[-1] == 3 for p in got)
    assert (3,) in got and (0, 1, 3) in got and (1, 2, 3) in got
    assert all(len(p) <= 3 for p in got)
    copy_of_small = (*STAGES[:1], StageConfig("int8", "int8_copy", copy_of=2), *STAGES[2:])
    assert (1, 3) not in candidates(copy_of_small, 3)  # the copy's source is not in the pipeline
    assert len(candidates(STAGES, 4)) == 8  # every subset of the three drafters


@pytest.mark.parametrize(
    "k,replicas,cores,ranks,bound,want",
    [(1, 1, 2, 3, False, 2), (2, 1, 2, 3, False, 1), (3, 1, 2, 3, False, 1), (2, 2, 8, 4, False, 2),
     (2, 1, 16, 3, False, 8), (3, 1, 4, 3, True, 4), (3, 1, 16, 1, False, 16)],
)  # fmt: skip
def test_threads_split_the_node_among_the_ranks_that_run(k, replicas, cores, ranks, bound, want):
    got = stage_shares(k, replicas, range(cores), ranks, bound)
    assert len(got) == k and {s.threads for s in got} == {want}


def test_a_model_free_stage_leaves_its_core_share_to_the_model_stages():
    # suffix -> target on 2 cores: the target gets both, as AR does (the job's share_cpus)
    assert [s.threads for s in stage_shares(2, 1, (0, 1), 2, False, light=frozenset({0}))] == [1, 2]
    assert [s.threads for s in stage_shares(3, 1, range(4), 3, False, light=frozenset({0}))] == [1, 2, 2]
    assert [s.threads for s in stage_shares(2, 1, range(4), 3, False)] == [2, 2]  # two model stages


def test_a_pipeline_is_measured_on_the_cpus_its_ranks_are_bound_to():
    # three stages on two CPUs: the target alone on the last, as share_cpus binds the job's ranks
    assert [s.cpus for s in stage_shares(3, 1, (0, 1), 3, False, bind=True)] == [(0,), (0,), (1,)]
    assert [s.cpus for s in stage_shares(3, 1, (0, 1), 3, False)] == [None] * 3  # a phase that does not bind
    assert [s.cpus for s in stage_shares(2, 1, (0, 1), 3, False, bind=True)] == [None] * 2  # not outnumbered


def agreement(target_path, *stages_props):
    """One prompt: each drafter's proposal per position (an int: one token, -1 none; a list:
    a lookup run), the target's path last."""
    as_run = lambda t: tuple(t) if isinstance(t, list) else (() if t < 0 else (t,))  # noqa: E731
    props = tuple((tuple(as_run(t) for t in p),) for p in stages_props)
    props += ((tuple((t,) for t in target_path),),)
    return Agreement(paths=(tuple(target_path),), proposals=props)


def test_agreement_counts_only_where_the_drafter_proposes_and_uses_the_targets_path():
    ag = agreement([5, 6, 7, 8], [5, -1, 0, 8], [5, 6, 0, 0])
    assert agreement_rate(ag, 0, 2) == pytest.approx(2 / 3)  # positions 0, 2, 3 proposed; 0 and 3 agree
    assert agreement_rate(ag, 1, 2) == pytest.approx(2 / 4)
    assert agreement_rate(ag, 0, 1) == pytest.approx(2 / 3)  # 5=5, 0=0; 8 != 0
    silent = agreement([1, 2], [-1, -1])
    assert agreement_rate(silent, 0, 1) is None


def test_lookup_rates():
    ag = agreement([1, 2, 3, 4, 5, 6], [[1, 2, 3], [2, 3], [], [], [5, 6], [6]])
    hit, chain = lookup_rates(ag, 0)
    assert hit == pytest.approx(4 / 6)
    assert chain == pytest.approx(2 / 3)  # after hits at 0, 1, 4: hits at 1 and 5, not 2


def test_a_lookup_run_is_judged_as_the_loop_meets_it():
    path = [1, 2, 3, 4, 5, 6, 7, 8]
    runs = [[1, 2, 9], [2, 3], [3], [4, 5, 6, 7], [], [6], [7, 8], [8]]
    # SD, window 2: at 0 [1, 2] matches, bonus at 2; at 3 [4, 5] matches, bonus at 5; 6 [7, 8]
    assert run_trace(runs, path, "sd", 2) == {0: True, 1: True, 3: True, 4: True, 6: True, 7: True}
    # PipeSpec: at 0 [1, 2, 9] stops matching at 2 (correction), at 3 [4, 5, 6, 7] all match,
    # the lookup goes on at 7 with [8]
    assert run_trace(runs, path, "pipespec", 0) == {0: True, 1: True, 2: False, 3: True, 4: True,
                                                     5: True, 6: True, 7: True}  # fmt: skip
    assert run_trace([[], [], []], [1, 2, 3], "pipespec", 0) == {}


def measured(drafter_ms: float, rate: float, target_ms: float = 40.0) -> Measured:
    """A drafter and a target; the target's path is 40 tokens; the drafter agrees on ``rate``."""
    path = list(range(40))
    agree = round(rate * 40)
    props = [t if i < agree else 1000 for i, t in enumerate(path)]
    pts = lambda ms, per: StageCost(((1, ms / 1e3), (16, (ms + 15 * per) / 1e3)))  # noqa: E731
    return Measured(
        stages=("drafter", "target"),
        kinds=("tiny", "tiny"),
        max_proposal=(8, 8),
        costs={(1,): (pts(target_ms, 0.5),), (0, 1): (pts(drafter_ms, 0.1), pts(target_ms * 1.1, 0.5))},
        threads={1: 2, 2: 1},
        agreement=agreement(path, props),
    )


DECODE = DecodeConfig(max_new_tokens=64)


def test_a_cheap_agreeing_drafter_is_chosen():
    plan = predict(measured(drafter_ms=4, rate=0.8), DECODE, max_stages=3, margin=0.05, seeds=(0,))
    assert plan.chosen.method in ("sd", "pipespec") and plan.chosen.pipeline == ("drafter", "target")
    assert plan.chosen.speedup > 1.5
    assert plan.options[0] == plan.ar


def test_ar_wins_when_the_drafter_costs_as_much_as_the_target():
    """The 2-core EPYC case: a middle stage whose one-token step is as slow as the target's."""
    plan = predict(measured(drafter_ms=40, rate=0.8), DECODE, max_stages=3, margin=0.05, seeds=(0,))
    assert plan.chosen == plan.ar and "margin" in plan.reason
    assert plan.best_speculative is not None and plan.best_speculative.speedup < 1.05


def test_ar_wins_when_the_drafter_never_agrees():
    plan = predict(measured(drafter_ms=2, rate=0.0), DECODE, max_stages=3, margin=0.05, seeds=(0,))
    assert plan.chosen == plan.ar


def test_the_margin_decides_a_close_call():
    m = measured(drafter_ms=4, rate=0.8)
    best = predict(m, DECODE, 3, margin=0.0, seeds=(0,)).chosen.speedup
    assert predict(m, DECODE, 3, margin=best - 1 + 0.01, seeds=(0,)).chosen.method == "ar"


def test_realize_runs_the_chosen_stages_with_copies_repointed_and_threads_set():
    cfg = compose_config(["hierarchy=auto", "method=pipespec"])
    m = Measured(
        stages=tuple(s.name for s in cfg.hierarchy.stages),
        kinds=tuple(s.kind for s in cfg.hierarchy.stages),
        max_proposal=(8,) * 5,
        costs={
            (4,): [StageCost(((1, 0.04),))],
            (2, 4): [StageCost(((1, 0.004), (16, 0.006))), StageCost(((1, 0.044), (16, 0.05)))],
        },
        threads={1: 2, 2: 1},
        agreement=agreement(list(range(30)), [-1] * 30, [-1] * 30, list(range(30)), [-1] * 30),
    )
    plan = predict(m, DECODE, 3, 0.05, seeds=(0,))
    run = realize(cfg, plan, bound=False)
    assert [s.name for s in run.hierarchy.stages] == ["smollm2-135m-int8", "smollm2-135m"]
    assert run.hierarchy.stages[0].copy_of == 1 and not run.hierarchy.choose
    assert [s.threads for s in run.hierarchy.stages] == [1, 1]
    assert run.method == plan.chosen.method
    assert realize(cfg, plan, bound=True).hierarchy.stages[0].threads is None
    # a model-free drafter's pipeline: the target runs with one model stage's threads (AR's)
    suffix = replace(plan.chosen, pipeline=("suffix", "smollm2-135m"))
    run = realize(cfg, replace(plan, chosen=suffix, best_speculative=suffix), bound=False)
    assert [(s.name, s.threads) for s in run.hierarchy.stages] == [("suffix", None), ("smollm2-135m", 2)]


def test_realize_for_the_online_plan_runs_the_longest_pipeline_holding_the_fastest_routes():
    """method=online: of the three-stage pipelines, the one whose routes hold the fastest predicted
    option; its routes in predicted order; no thread counts (each route shares the node its own
    way); the method stays online."""
    cfg = compose_config(["hierarchy=auto"])
    names = [s.name for s in cfg.hierarchy.stages]  # lookup, suffix, int8, w8, target
    target = names[-1]

    def opt(method: str, pipeline: tuple[str, ...], ms: float) -> Option:
        return Option(method, pipeline, 1, ms, 20.0 / ms)

    options = (
        opt("pipespec", ("suffix", target), 14.0),
        opt("pipespec", ("suffix", names[3], target), 18.0),
        opt("pipespec", (names[0], names[2], target), 16.0),
        opt("pipespec", (names[3], target), 25.0),
        opt("ar", (target,), 20.0),
    )
    plan = Plan(options[0], options[0], options[-1], 0.05, "", options)
    run = realize(cfg, plan, bound=False)
    assert [s.name for s in run.hierarchy.stages] == ["suffix", names[3], target]
    assert run.online.routes == ("0-2", "0-1-2")  # the suffix drafter kept (1-2 drops it)
    assert run.method == "online" and all(s.threads is None for s in run.hierarchy.stages)
    assert run.hierarchy.stages[1].copy_of == 2


def test_measurements_round_trip_through_json():
    m = measured(4, 0.5)
    assert Measured.from_json(json.loads(json.dumps(m.to_json()))) == m


def test_the_cache_answers_only_for_what_it_was_measured_for(tmp_path):
    cache = MeasurementCache(tmp_path)
    parts = {"machine": cpu_identity(), "stages": ["a", "b"]}
    assert cache.get("costs", parts) is None
    cache.put("costs", parts, {"x": 1})
    assert cache.get("costs", parts) == {"x": 1}
    assert cache.get("costs", {**parts, "stages": ["a"]}) is None
    cache.path("costs", parts).write_text('{"for": ')  # torn: measured again, never trusted
    assert cache.get("costs", parts) is None


def test_costs_measured_with_other_kernels_are_not_reused(tmp_path, monkeypatch):
    from pipespec_mpi.auto import fingerprint
    from pipespec_mpi.models.cpu import flat_linear

    here = fingerprint.machine(2, 3)
    assert here["kernels"] == flat_linear.kernels_digest()
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    for src in flat_linear.KERNELS.iterdir():
        (kernels / src.name).write_bytes(src.read_bytes())
    monkeypatch.setattr(flat_linear, "KERNELS", kernels)
    flat_linear.kernels_digest.cache_clear()
    try:
        assert flat_linear.kernels_digest() == here["kernels"]  # the same sources, the same key
        flat_linear.kernels_digest.cache_clear()
        (kernels / "attention.cpp").write_text((kernels / "attention.cpp").read_text() + "// edited\n")
        other = fingerprint.machine(2, 3)
    finally:
        flat_linear.kernels_digest.cache_clear()
    assert other["kernels"] != here["kernels"]
    cache = MeasurementCache(tmp_path / "cache")
    cache.put("costs", {"machine": here}, {"x": 1})
    assert cache.get("costs", {"machine": other}) is None


def test_calibration_prompts_are_the_jobs_first_or_a_given_file(tmp_path):
    from pipespec_mpi.auto.calibrate import calibration_prompts
    from pipespec_mpi.data.datasets import DatasetError
    from pipespec_mpi.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer(None)
    base = ["hierarchy=tiny", "dataset=synthetic", "dataset.n_prompts=5", "auto.calibration_prompts=2"]
    own = calibration_prompts(compose_config(base), tok)
    assert len(own) == 2
    given = tmp_path / "calib.jsonl"
    given.write_text('{"prompt": "def f(x):"}\n{"prompt": "abc"}\n{"prompt": "unused"}\n')
    got = calibration_prompts(compose_config([*base, f"auto.calibration_path={given}"]), tok)
    assert got == [tok.encode("def f(x):", chat=False), tok.encode("abc", chat=False)] != own
    with pytest.raises(DatasetError, match="auto.calibration_path"):
        calibration_prompts(compose_config([*base, "auto.calibration_path=/nonexistent.jsonl"]), tok)


def test_batch_sizes_pick_the_highest_throughput_and_fall_back_to_batched_ar():
    """With a target whose forward cost hardly grows with rows (memory-bound), batching pays for
    AR and speculation alike: the plan takes the largest batch; where extra rows cost as much as
    a step (compute-bound), speculation's verification rows lose to batched AR."""
    flat = measured(drafter_ms=4, rate=0.8)
    plan = predict(flat, DECODE, 3, margin=0.05, seeds=(0,), batch_sizes=(1, 4))
    assert plan.chosen.batch_size == 4 and plan.chosen.method in ("sd", "pipespec")
    assert {o.batch_size for o in plan.options} == {1, 4}
    assert "at batch 4" in plan.reason and "best AR" in plan.reason
    steep = measured(drafter_ms=4, rate=0.3)
    steep.costs[(1,)] = (StageCost(((1, 0.040), (16, 0.040 * 16))),)
    steep.costs[(0, 1)] = (steep.costs[(0, 1)][0], StageCost(((1, 0.044), (16, 0.044 * 16))))
    plan = predict(steep, DECODE, 3, margin=0.05, seeds=(0,), batch_sizes=(1, 4))
    assert plan.chosen.method == "ar" and plan.chosen == plan.ar and "AR" in plan.reason
    tiny = compose_config(["hierarchy=tiny", "method=pipespec"])
    names = tuple(st.name for st in tiny.hierarchy.stages[1:])
    batched = replace(plan.best_speculative, pipeline=names, batch_size=4)
    assert realize(tiny, replace(plan, chosen=batched), bound=False).decode.batch_size == 4


def test_the_job_plan_measure_and_plan_from_its_run_choose_the_same(tmp_path, monkeypatch, capsys):
    """hierarchy=auto's choice (rank 0), ``pipespec-plan --measure`` and ``pipespec-plan RUN_DIR``
    the job's run directory, fed the same measurements, choose the same option: one search."""
    from types import SimpleNamespace

    from pipespec_mpi.auto import calibrate as calibrate_module
    from pipespec_mpi.auto.calibrate import Calibration
    from pipespec_mpi.plan import cli, job
    from pipespec_mpi.plan.record import read_plan, write_plan
    from pipespec_mpi.plan.table import option_cells

    base = ["hierarchy=tiny2", "dataset=synthetic", f"auto.cache_dir={tmp_path / 'cache'}"]
    cfg = compose_config([*base, "hierarchy.choose=true"])
    m = replace(measured(drafter_ms=4, rate=0.8), stages=tuple(s.name for s in cfg.hierarchy.stages))
    cal = Calibration(m, max_stages=2, seconds=0.0, cached=("costs", "agreement"), cache_files={})
    monkeypatch.setattr(calibrate_module, "calibrate", lambda *a, **k: cal)
    monkeypatch.setattr(job, "calibrate", lambda *a, **k: cal)
    _, record = job.choose_on_rank0(cfg, SimpleNamespace(size=2, local_size=2))
    run = tmp_path / "run"
    run.mkdir()
    write_plan(run, record)
    assert read_plan(run) == record  # plan.json read back as it was written (one writer, one reader)
    chosen = record.plan.chosen
    assert chosen.method in ("sd", "pipespec")
    cells = option_cells(chosen, chosen)
    assert cli.main([str(run)]) == 0
    from_run = capsys.readouterr().out
    assert cli.main(["--measure", "--ranks", "2", *base]) == 0
    measured_here = capsys.readouterr().out
    for out in (from_run, measured_here):  # the same row, marked chosen, in both tables
        assert any(line.split()[1:] == " ".join(cells).split() for line in out.splitlines()), out


def test_a_target_timing_that_disagrees_with_its_others_is_found():
    """The target (the last stage) timed in every pipeline: among pipelines of one length (the
    same threads) each timing near their median; alone not slower than inside a pipeline."""

    def costs(alone_ms: float, inside_ms: dict[tuple[int, ...], float]) -> dict:
        out = {(3,): [StageCost(((1, alone_ms / 1e3),))]}
        for p, ms in inside_ms.items():
            out[p] = [StageCost(((1, 0.001),))] * (len(p) - 1) + [StageCost(((1, ms / 1e3),))]
        return out

    pairs = {(0, 3): 38.0, (1, 3): 50.0, (2, 3): 57.0}  # beside a lookup, an int8 and a bf16 copy
    assert disagreeing(costs(34.0, pairs), 1.5) == []
    assert disagreeing(costs(34.0, {**pairs, (1, 3): 600.0}), 1.5) == [(1, 3)]  # a busy process
    assert disagreeing(costs(400.0, pairs), 1.5) == [(3,)]  # AR timed beside one: 8x a pipeline's
    assert disagreeing(costs(34.0, {(0, 3): 38.0, (1, 3): 600.0}), 1.5) == []  # two: no median
    # two busy neighbours slow the target more than one idle lookup stage and one busy copy: a
    # pipeline is compared only with those that have as many busy stages
    three = {(0, 1, 3): 45.0, (0, 2, 3): 50.0, (0, 1, 2, 3): 52.0, (1, 2, 3): 120.0}
    free = frozenset({0})  # stage 0 is a lookup stage
    assert disagreeing(costs(34.0, {**pairs, **three}), 1.5, free) == []
    assert disagreeing(costs(34.0, {**pairs, **three}), 1.5) == [(1, 2, 3)]  # all as busy: flagged
    # a StageCost survives its JSON (the cache) unchanged
    c = StageCost(((1, 0.01), (16, 0.02)), prefill_s=0.3, context=64, per_sequence_s=0.001)
    assert StageCost.from_json(json.loads(json.dumps(c.to_json()))) == c and c.one_token_s == 0.01


def test_a_disturbed_pipeline_timing_is_timed_again():
    """measure_costs times again what ``disagreeing`` finds, once, and says what still disagrees."""
    from pipespec_mpi.auto.measure import measure_costs

    class Timings:  # what each pipeline's target takes, the first time and after
        hier = compose_config(["hierarchy=tiny4"]).hierarchy  # four model stages

        def __init__(self, first: dict, later: dict) -> None:
            self.first, self.later, self.calls = first, later, []

        def costs(self, p, shares, context, token_counts, repeats):
            ms = (self.later if p in self.calls else self.first)[p]
            self.calls.append(p)
            return [StageCost(((1, 0.001),))] * (len(p) - 1) + [StageCost(((1, ms / 1e3),))]

    ps = [(3,), (0, 3), (1, 3), (2, 3)]
    shares = {(3,): (CpuShare(2),), **{p: (CpuShare(1),) * 2 for p in ps[1:]}}
    calm = {(3,): 34.0, (0, 3): 38.0, (1, 3): 50.0, (2, 3): 57.0}
    w = Timings({**calm, (1, 3): 600.0}, calm)
    got, check = measure_costs(w, ps, shares, [1, 2], (1,), 3, factor=1.5)
    assert check.remeasured == ((1, 3),) and check.still_off == () and w.calls.count((1, 3)) == 2
    assert got[(1, 3)][-1].one_token_s == 0.050
    w = Timings({**calm, (1, 3): 600.0}, {**calm, (1, 3): 700.0})
    _, check = measure_costs(w, ps, shares, [1, 2], (1,), 3, factor=1.5)
    assert check.still_off == ((1, 3),) and check.to_json() == {"remeasured": [[1, 3]], "still_off": [[1, 3]]}
