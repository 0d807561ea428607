"""hierarchy=auto end to end under real mpirun, on the tiny candidates: it measures, chooses, runs
the choice on the ranks it needs (the others wait and leave with the job), stays lossless, records
the plan, and a second job on the same machine plans from the cache."""

from __future__ import annotations

import json

import pytest
from conftest import launch_ok

from pipespec_mpi.records import Record

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
TINY = ["hierarchy=tiny", "dataset=synthetic", "dataset.n_prompts=3", "decode.max_new_tokens=32"]
FIXED = "method=pipespec"  # auto's own choice (method, window), run as it is; the default: online
QUICK = [
    "auto.calibration_prompts=2",
    "auto.calibration_tokens=16",
    "auto.repeats=2",
    "auto.token_counts=[1,4]",
]


def outputs(records: list[Record]) -> dict[str, list[int]]:
    """prompt -> output ids."""
    return {r.prompt_id: r.output_ids for r in records}


@pytest.fixture(scope="module")
def ar(tmp_path_factory):
    """The target alone on TINY's prompts (tiny and tiny_suffix share the target): what every
    greedy choice must output."""
    return outputs(launch_ok(3, [*TINY, "method=ar"], tmp_path_factory.mktemp("ar")))


def test_auto_chooses_runs_losslessly_and_plans_from_the_cache_the_second_time(tmp_path, ar):
    # auto.off_factor: the tiny models (all loop overhead) may run further from the prediction than
    # the default allows, which would drop the costs this case means to reuse (the rule itself:
    # tests/unit/auto/test_calibrate.py)
    cache = f"auto.cache_dir={tmp_path / 'cache'}"
    quick = [*QUICK, "auto.off_factor=100"]
    first = launch_ok(3, [*TINY, FIXED, "hierarchy.choose=true", *quick, cache], tmp_path / "auto1")
    plan = json.loads((tmp_path / "auto1" / "plan.json").read_text())
    assert plan["from_cache"] == []
    assert plan["chosen"]["method"] in ("ar", "sd", "pipespec")
    assert plan["chosen"]["pipeline"][-1] == "tiny-target-4L"
    assert {r.method for r in first} == {plan["chosen"]["method"]}
    assert outputs(first) == ar  # greedy: whatever was chosen, the target's own output
    assert plan["measured_ms_per_token"][plan["chosen"]["method"]] > 0
    assert "tiny-draft-1L -> tiny-target-4L" in plan["rates"]

    second = launch_ok(3, [*TINY, FIXED, "hierarchy.choose=true", *quick, cache], tmp_path / "auto2")
    again = json.loads((tmp_path / "auto2" / "plan.json").read_text())
    assert plan["spot_check"] is None
    # the second planned with what the first measured against its predictions (plan/refit.py)
    assert plan["refit_next"] and again["inputs"]["refit"] == plan["refit_next"]
    if (plan["cost_check"] or {}).get("still_off"):  # a busy machine: the first job's timings of the target
        # disagreed even when timed again, so it did not cache them and the second measures anew
        assert again["spot_check"] is None and again["from_cache"] == ["agreement"]
        assert outputs(second) == ar
        return
    assert again["spot_check"]["factor"] == 1.5
    # the cached costs are used where the target's step, timed again, agrees with them (a busy
    # moment of the machine may make it disagree: then they are measured again)
    agrees = again["spot_check"]["verdict"] == "agrees"
    assert again["from_cache"] == (["costs", "agreement"] if agrees else ["agreement"])
    assert outputs(second) == ar


def test_auto_under_the_online_plan_measures_its_routes_losslessly(tmp_path, ar):
    """The default method (online): auto runs its chosen stages, the online plan measures the
    routes it ordered by prediction, and plan.json sets each measured plan beside its prediction."""
    cache = f"auto.cache_dir={tmp_path / 'cache'}"
    recs = launch_ok(
        3, [*TINY, "hierarchy.choose=true", "auto.off_factor=100", *QUICK, cache], tmp_path / "auto"
    )
    plan = json.loads((tmp_path / "auto" / "plan.json").read_text())
    # its stages: the longest pipeline holding the fastest predicted option (with the tiny models'
    # costs timed on a busy machine, a drafter may be measured slower than the target and left
    # out: then two stages)
    assert plan["runs"]["method"] == "online" and plan["runs"]["hierarchy"].count("+") in (1, 2)
    assert {r.method for r in recs} == {"online"} and outputs(recs) == ar
    ran = {r.decoded_by for r in recs}
    assert len(ran) >= 2  # three prompts, each on another plan while it explores (AR and a route at least)
    assert set(plan["online_vs_predicted"]) == ran
    assert all(v["measured"] > 0 and v["predicted"] > 0 for v in plan["online_vs_predicted"].values())
    assert len(plan["refit_next"]) == len(ran)  # each measured plan refits its own prediction


@pytest.mark.long
def test_auto_falls_back_to_ar_and_the_spare_ranks_leave_with_the_job(tmp_path, ar):
    cache = f"auto.cache_dir={tmp_path / 'cache'}"
    recs = launch_ok(
        3, [*TINY, FIXED, "hierarchy.choose=true", "auto.margin=100", *QUICK, cache], tmp_path / "auto"
    )
    plan = json.loads((tmp_path / "auto" / "plan.json").read_text())
    assert plan["chosen"]["method"] == "ar" and "margin 100" in plan["reason"]
    assert plan["runs"]["hierarchy"] == "tiny[tiny-target-4L]" and plan["runs"]["methods"] == ["ar"]
    assert {r.method for r in recs} == {"ar"} and outputs(recs) == ar
    logs = "".join(p.read_text() for p in (tmp_path / "auto").glob("rank*.log"))
    assert "rank 1 is spare" in logs and "rank 2 is spare" in logs


@pytest.mark.long
def test_auto_chooses_a_batch_size_and_the_job_runs_at_it(tmp_path, ar):
    """auto.batch_sizes: the plan weighs every method at batch 1 and 3 by throughput, the job
    decodes at the chosen size, losslessly, and plan.json says which and why."""
    cache = f"auto.cache_dir={tmp_path / 'cache'}"
    recs = launch_ok(
        3, [*TINY, FIXED, "hierarchy.choose=true", "auto.batch_sizes=[1,3]", *QUICK, cache], tmp_path / "auto"
    )
    plan = json.loads((tmp_path / "auto" / "plan.json").read_text())
    chosen = plan["chosen"]
    assert chosen["batch_size"] in (1, 3)
    assert {o["batch_size"] for o in plan["options"]} == {1, 3}
    assert {(r.method, r.batch_size) for r in recs} == {(chosen["method"], chosen["batch_size"])}
    assert outputs(recs) == ar
    assert plan["measured_vs_predicted"] > 0  # the measured group (method at its batch size) was found
    if chosen["method"] == "ar":  # the fallback names the best AR's batch size
        assert f"the best AR's throughput (batch {chosen['batch_size']})" in plan["reason"]
    else:
        assert f"with {chosen['method']} at batch {chosen['batch_size']}" in plan["reason"]


@pytest.mark.long
def test_auto_weighs_a_suffix_drafter_among_its_candidates(tmp_path, ar):
    """tiny_suffix's stages as candidates: the suffix drafter is measured (its proposals along the
    target's path, drafting from the earlier calibration prompts' outputs too), every pipeline it
    can head is predicted, and the job runs the choice losslessly."""
    cache = f"auto.cache_dir={tmp_path / 'cache'}"
    base = ["hierarchy=tiny_suffix", *TINY[1:]]
    recs = launch_ok(3, [*base, "hierarchy.choose=true", *QUICK, cache], tmp_path / "auto")
    plan = json.loads((tmp_path / "auto" / "plan.json").read_text())
    assert "suffix -> tiny-target-4L" in plan["rates"] and "suffix -> tiny-mid-3L" in plan["rates"]
    pipelines = {tuple(o["pipeline"]) for o in plan["options"]}
    assert ("suffix", "tiny-target-4L") in pipelines
    # the three stages are predicted too, unless the middle model is too slow to be measured
    # beside the target (a one-token step as slow as the target's: auto/measure.py)
    three = ("suffix", "tiny-mid-3L", "tiny-target-4L")
    assert three in pipelines or " -> ".join(three) in plan["not_measured"]
    assert outputs(recs) == ar
