"""The refit: what auto jobs measured corrects the next plan's predictions (plan/refit.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from pipespec_mpi.auto.calibrate import CalibrationSummary
from pipespec_mpi.config import DecodeConfig, compose_config
from pipespec_mpi.plan import job
from pipespec_mpi.plan.options import Grid, Plan, Setting
from pipespec_mpi.plan.record import PlanRecord, read_plan
from pipespec_mpi.plan.refit import JOBS_KEPT, Observation, Refit, RefitMemory, RefitSource
from pipespec_mpi.plan.search import search

SPEC = ("suffix", "smollm2")  # a model-free drafter into the target
THREE = ("suffix", "mid", "smollm2")


@dataclass
class Sim:
    """A source predicting fixed ms/token per (method, pipeline), the simulator's stand-in."""

    ms_of: dict = field(default_factory=dict)
    target: str = "smollm2"
    threads: dict = field(default_factory=dict)

    def pipelines(self, max_stages: int) -> list[tuple[str, ...]]:
        return [p for m, p in self.ms_of if m != "ar" and len(p) <= max_stages]

    def ms(self, pipeline, setting: Setting, decode: DecodeConfig) -> float:
        return self.ms_of[setting.method, tuple(pipeline)]


# What a 2-core node predicted and measured (docs/notebook.md, "The online plan"): the simulator
# put suffix -> SmolLM2 at 0.97x AR; jobs measured it at 1.29x
SIM = Sim({("ar", ("smollm2",)): 10.3, ("pipespec", SPEC): 10.6, ("pipespec", THREE): 12.0})
GRID = Grid(lookaheads=(4,), sd_windows=(), adaptive=False)


def plan(refit: Refit) -> Plan:
    return search(RefitSource(SIM, refit), DecodeConfig(), GRID, max_stages=3, margin=0.05)


def test_a_first_job_sets_each_ratio_and_the_next_plan_predicts_what_it_measured():
    before = plan(Refit())
    assert before.chosen.method == "ar"  # 0.97x predicted: below the margin
    seen = [Observation("pipespec", SPEC, 1, 8.0, 10.6), Observation("ar", ("smollm2",), 1, 10.3, 10.3)]
    refit = Refit().updated(seen)
    after = plan(refit)
    assert after.chosen.method == "pipespec" and after.chosen.pipeline == SPEC
    assert after.chosen.ms_per_token == pytest.approx(8.0, rel=1e-3)
    assert after.ar.ms_per_token == pytest.approx(10.3, rel=1e-3)
    # an option no job measured: its method's median ratio at its batch size
    three = next(o for o in after.options if o.pipeline == THREE)
    assert three.ms_per_token == pytest.approx(12.0 * 8.0 / 10.6, rel=1e-3)


def test_a_ratio_is_the_geometric_mean_of_the_recent_jobs():
    refit = Refit()
    for measured in (8.0, 12.0):  # each predicted under the refit the job planned with
        predicted = 10.0 * refit.factor("pipespec", SPEC, 1)
        refit = refit.updated([Observation("pipespec", SPEC, 1, measured, predicted)])
    assert refit.factor("pipespec", SPEC, 1) == pytest.approx((0.8 * 1.2) ** 0.5, rel=1e-3)
    for _ in range(3 * JOBS_KEPT):  # the newest jobs take over: drift moves on
        refit = refit.updated(
            [Observation("pipespec", SPEC, 1, 5.0, 10.0 * refit.factor("pipespec", SPEC, 1))]
        )
    assert refit.factor("pipespec", SPEC, 1) == pytest.approx(0.5, rel=0.05)
    assert refit.ratios[0].jobs == JOBS_KEPT


def test_ratios_stay_with_their_method_and_batch_size():
    refit = Refit().updated([Observation("pipespec", SPEC, 4, 5.0, 10.0)])
    assert refit.factor("pipespec", SPEC, 4) == pytest.approx(0.5)
    assert refit.factor("pipespec", SPEC, 1) == 1.0
    assert refit.factor("ar", ("smollm2",), 4) == 1.0
    assert Refit.from_json(json.loads(json.dumps(refit.to_json()))) == refit


def test_the_node_memory_round_trips_under_its_key(tmp_path):
    cfg = compose_config(["hierarchy=auto", f"auto.cache_dir={tmp_path}"])
    refit = Refit().updated([Observation("pipespec", SPEC, 1, 8.0, 10.6)])
    RefitMemory(cfg, cores=2, ranks_on_node=3).save(refit)
    assert RefitMemory(cfg, cores=2, ranks_on_node=3).load() == refit
    assert RefitMemory(cfg, cores=2, ranks_on_node=2).load() == Refit()  # another sharing of the node
    news = compose_config(["hierarchy=auto", f"auto.cache_dir={tmp_path}", "dataset=news"])
    assert RefitMemory(news, cores=2, ranks_on_node=3).load() == Refit()  # another dataset
    batched = compose_config(["hierarchy=auto", f"auto.cache_dir={tmp_path}", "decode.batch_size=4"])
    assert RefitMemory(batched, cores=2, ranks_on_node=3).load() == refit  # ratios keep their own size


class Kept:
    def __init__(self) -> None:
        self.saved: list[Refit] = []

    def save(self, refit: Refit) -> None:
        self.saved.append(refit)


def test_an_online_job_refits_every_plan_it_measured(tmp_path, monkeypatch):
    """add_measured: each plan of online.json against its prediction, into plan.json and the
    node's refit; the next plan from the same measurements predicts what this job measured."""
    first = plan(Refit())
    ms = {"pipespec 0-2": 8.0, "pipespec 0-1-2": 13.0, "ar": 10.0}
    online = {"1": {"ms_per_token": ms, "runs": {"pipespec 0-2": 12, "pipespec 0-1-2": 1, "ar": 1}}}
    (tmp_path / "online.json").write_text(json.dumps(online))
    monkeypatch.setattr(
        job,
        "read_summary",
        lambda path: {"online": SimpleNamespace(method="online", batch_size=1, ms_per_token=9.0)},
    )
    cal = CalibrationSummary(1.0, {}, [], {}, None, [], list(THREE), {})
    inputs = SimpleNamespace(refit=Refit(), to_json=dict)  # planned under no refit yet
    record = PlanRecord(first, cal, "h", None, None, inputs)
    kept = Kept()
    after = job.add_measured(tmp_path, record, off_factor=2.0, memory=kept)
    assert after.online_vs_predicted == {
        "pipespec 0-2": {"measured": 8.0, "predicted": 10.6},
        "pipespec 0-1-2": {"measured": 13.0, "predicted": 12.0},
        "ar": {"measured": 10.0, "predicted": 10.3},
    }
    assert kept.saved == [after.refit_next]
    again = plan(after.refit_next)
    for o in again.options:
        measured = {SPEC: 8.0, THREE: 13.0, ("smollm2",): 10.0}[o.pipeline]
        assert o.ms_per_token == pytest.approx(measured, rel=1e-3)
    assert read_plan(tmp_path).refit_next == after.refit_next
    # a later job that ran only 0-2 and AR: 0-1-2's estimate in its online.json is remembered
    # from this one (the online plan's memory), not measured again, so it refits nothing
    online["1"]["runs"] = {"pipespec 0-2": 13, "ar": 1, "pipespec 0-1-2": 0}
    (tmp_path / "online.json").write_text(json.dumps(online))
    record = PlanRecord(again, cal, "h", None, None, SimpleNamespace(refit=after.refit_next, to_json=dict))
    later = job.add_measured(tmp_path, record, off_factor=2.0, memory=kept)
    assert set(later.online_vs_predicted) == {"pipespec 0-2", "ar"}
    (three,) = [r for r in later.refit_next.ratios if r.pipeline == THREE]
    assert three.jobs == 1  # not counted twice


def test_a_later_job_observes_against_the_refit_prediction():
    """A job planned under a refit saw a prediction already corrected: its ratio is measured
    over the simulator's own prediction, not over the corrected one."""
    refit = Refit().updated([Observation("pipespec", SPEC, 1, 8.0, 10.0)])  # 0.8
    corrected = 10.0 * refit.factor("pipespec", SPEC, 1)
    again = refit.updated([Observation("pipespec", SPEC, 1, 8.0, corrected)])
    assert again.factor("pipespec", SPEC, 1) == pytest.approx(0.8)
