"""hierarchy=auto checks its measurements before it trusts them: a cached cost is spot-checked
against one short timing of the target (real measuring workers on the tiny models), and a run far
from its prediction says so and drops the cached costs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipespec_mpi.auto.calibrate import CalibrationSummary, Node, SpotCheck, calibrate, calibration_prompts
from pipespec_mpi.auto.measure import within
from pipespec_mpi.config import compose_config
from pipespec_mpi.plan import job
from pipespec_mpi.plan.options import Option, Plan
from pipespec_mpi.plan.record import PLAN, PlanRecord, read_plan

QUICK = ["hierarchy=tiny2", "dataset=synthetic", "hierarchy.choose=true", "auto.calibration_prompts=1",
         "auto.calibration_tokens=8", "auto.repeats=2", "auto.token_counts=[1,2]",
         "auto.max_stages=1"]  # fmt: skip


def test_within_is_a_factor_either_way():
    assert within(10.0, 10.0, 1.5) and within(14.9, 10.0, 1.5) and within(6.7, 10.0, 1.5)
    assert not within(15.1, 10.0, 1.5) and not within(6.6, 10.0, 1.5)
    assert SpotCheck(0.323, 0.025, 1.5).to_json()["verdict"] == "stale: measured again"
    assert SpotCheck(0.025, 0.027, 1.5).agrees


def test_a_stale_cached_cost_is_measured_again(tmp_path):
    """The cache as a job beside a busy process would have left it: every cost a million times
    what this machine takes now (a factor no load on this machine comes near: the measurements
    here, of a tiny model's sub-millisecond step, vary 10x and more when CI shares its cores). The
    spot check catches it, the costs are measured again and re-cached; the agreement (no timing in
    it) still comes from the cache."""
    from pipespec_mpi.models.loader import load_tokenizer

    cfg = compose_config([*QUICK, f"auto.cache_dir={tmp_path}"])
    node = Node.here(replicas=1, world_size=3, ranks_on_node=3, bound=False)
    tok = load_tokenizer(cfg.hierarchy.tokenizer, cfg.hierarchy.name)
    prompts = calibration_prompts(cfg, tok)
    first = calibrate(cfg, prompts, tok.eos_token_id, node)
    assert first.cached == () and first.spot is None
    path = Path(first.cache_files["costs"])
    doc = json.loads(path.read_text())
    for _, stages in doc["value"]["costs"]:
        for cost in stages:
            cost["points"] = [[n, 1e6 * s] for n, s in cost["points"]]
    path.write_text(json.dumps(doc))

    again = calibrate(cfg, prompts, tok.eos_token_id, node)
    assert again.spot is not None and not again.spot.agrees
    assert again.spot.cached_s > 1000 * again.spot.measured_s
    assert again.cached == ("agreement",)
    fresh = json.loads(path.read_text())["value"]
    target_alone = next(c for p, c in fresh["costs"] if p == [cfg.hierarchy.n_stages - 1])
    assert dict(target_alone[0]["points"])[1] < again.spot.cached_s / 1000  # re-cached as measured now


# (chosen measured, AR measured, off): AR predicted 50 ms, PipeSpec 25 ms. The last case is the
# busy-cache job: its choice within 2x of its prediction, AR 6x faster than predicted.
@pytest.mark.parametrize(
    "measured_ms, ar_ms, off",
    [(30.0, 60.0, False), (49.0, 60.0, False), (60.0, 60.0, True), (10.0, 60.0, True), (30.0, 8.0, True)],
)
def test_a_run_far_from_its_prediction_says_so_and_drops_the_cached_costs(
    tmp_path, monkeypatch, measured_ms, ar_ms, off
):
    costs = tmp_path / "costs.json"
    costs.write_text("{}")
    agreement = tmp_path / "agreement.json"
    agreement.write_text("{}")
    summary = {
        "pipespec": SimpleNamespace(method="pipespec", batch_size=1, ms_per_token=measured_ms),
        "ar": SimpleNamespace(method="ar", batch_size=1, ms_per_token=ar_ms),
    }
    monkeypatch.setattr(job, "read_summary", lambda path: summary)
    chosen = Option("pipespec", ("d", "t"), 0, 25.0, 2.0)
    ar = Option("ar", ("t",), 0, 50.0, 1.0)
    cal = CalibrationSummary(calibration_s=1.0, calibration_phases_s={}, from_cache=["costs", "agreement"],
                             cache_files={"costs": str(costs), "agreement": str(agreement)}, spot_check=None,
                             not_measured=[], stages=["d", "t"], rates={"d -> t": 0.8})  # fmt: skip
    plan = Plan(chosen, chosen, ar, 0.05, "predicted 2.00x AR", (ar, chosen))
    record = PlanRecord(plan, cal, "h", None, None, None)
    after = job.add_measured(tmp_path, record, off_factor=2.0)
    assert read_plan(tmp_path) == after and after.plan == plan  # one writer, one reader
    plan = json.loads((tmp_path / PLAN).read_text())
    assert plan["measured_vs_predicted"] == pytest.approx(measured_ms / 25.0, abs=1e-3)
    assert ("prediction_off" in plan) == off
    assert plan["ar_measured_vs_predicted"] == pytest.approx(ar_ms / 50.0, abs=1e-3)
    assert ("ar measured" in plan.get("prediction_off", "")) == (ar_ms == 8.0)
    assert costs.exists() != off  # dropped only when the run was far off
    assert agreement.exists()  # greedy paths do not depend on the node's load


def test_costs_whose_timings_still_disagree_are_used_but_not_cached(tmp_path, monkeypatch):
    """A node disturbed throughout the measurement: the target's timings disagreed, were timed
    again and disagreed again. The job plans with them (they are all it has), says so in
    plan.json's cost_check, and leaves nothing in the cache for the next job to trust."""
    from pipespec_mpi.auto import calibrate as calibrate_module
    from pipespec_mpi.auto.measure import CostCheck, measure_costs

    def disturbed(*args, **kw):
        got, _ = measure_costs(*args, **kw)
        alone = next(p for p in got if len(p) == 1)
        return got, CostCheck((alone,), (alone,))

    monkeypatch.setattr(calibrate_module, "measure_costs", disturbed)
    cfg = compose_config([*QUICK, f"auto.cache_dir={tmp_path}"])
    node = Node.here(replicas=1, world_size=3, ranks_on_node=3, bound=False)
    from pipespec_mpi.models.loader import load_tokenizer

    tok = load_tokenizer(cfg.hierarchy.tokenizer, cfg.hierarchy.name)
    cal = calibrate(cfg, calibration_prompts(cfg, tok), tok.eos_token_id, node)
    assert cal.check is not None and cal.check.still_off and cal.measured.costs
    assert not Path(cal.cache_files["costs"]).exists() and Path(cal.cache_files["agreement"]).exists()
    assert calibrate_module.summary(cal).cost_check["still_off"] == [[cfg.hierarchy.n_stages - 1]]
