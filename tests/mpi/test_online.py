"""The online plan under real mpirun (run/online.py, run/decisions.py): forced to switch plans
prompt by prompt, it commits AR's tokens on every prompt through every switch, on every route,
over tagged links (mpi) and over one link per pair (strict: NCCL's rules), batched too; a prompt
sampled by Leviathan's rule stays on the whole hierarchy; a second job starts from what the first
measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import launch_ok, outputs

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

# an exploration longer than the job: the plans take turns prompt by prompt, whatever the timings
SWITCHING = ["online.explore=100"]


def base(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "hierarchy=tiny", "run.mode=benchmark", "run.methods=[ar,online]", "dataset=synthetic",
        "decode.max_new_tokens=24", f"auto.cache_dir={tmp_path / 'cache'}", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("transport", ["mpi", "strict"])
def test_switching_plans_commits_ars_tokens(tmp_path, transport):
    recs = launch_ok(3, base(tmp_path, "dataset.n_prompts=10", f"transport.kind={transport}", *SWITCHING),
                     tmp_path / "run")  # fmt: skip
    by = outputs(recs)
    assert by[("online", 1)] == by[("ar", 1)]
    online = [r for r in recs if r.method == "online" and not r.warmup]
    plans = [r.decoded_by for r in online]
    assert set(plans) == {"pipespec 0-1-2", "pipespec 0-2", "pipespec 1-2", "ar"}
    assert all(a != b for a, b in zip(plans, plans[1:]))  # switched prompt by prompt
    for r in online:
        assert r.plan_note
        route = [int(s) for s in r.decoded_by.split()[-1].split("-")] if r.decoded_by != "ar" else [2]
        assert r.route == route
        idle = [s.stage for s in r.stages if s.stage not in route]
        assert all(r.stages[s].forward_calls == 0 and r.stages[s].tokens_proposed == 0 for s in idle)
    report = json.loads((tmp_path / "run" / "online.json").read_text())
    assert sum(report["1"]["runs"].values()) == len(online)


def test_batched_chunks_switch_plans_and_commit_ars_tokens(tmp_path):
    extra = ("dataset.n_prompts=12", "run.batch_sizes=[3]", "online.chunk=1", *SWITCHING)
    recs = launch_ok(3, base(tmp_path, *extra), tmp_path / "run")
    by = outputs(recs)
    assert by[("online", 3)] == by[("ar", 3)]
    plans = {r.decoded_by for r in recs if r.method == "online"}
    assert plans == {"pipespec 0-1-2", "pipespec 0-2", "pipespec 1-2", "ar"}


def test_a_leviathan_sample_stays_on_the_whole_hierarchy(tmp_path):
    extra = ("dataset.n_prompts=4", "sampling.temperature=1.0", "sampling.coupling=leviathan", *SWITCHING)
    recs = launch_ok(3, base(tmp_path, *extra), tmp_path / "run")
    online = [r for r in recs if r.method == "online"]
    assert {r.decoded_by for r in online} == {"pipespec 0-1-2"}
    assert all("Leviathan" in r.plan_note for r in online if not r.warmup)


def test_a_second_job_starts_from_what_the_first_measured(tmp_path):
    over = ["hierarchy=tiny", "dataset=synthetic", "dataset.n_prompts=6", "decode.max_new_tokens=24",
            f"auto.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    first = launch_ok(3, over, tmp_path / "first")
    assert first[0].plan_note.startswith("exploring")
    second = launch_ok(3, over, tmp_path / "second")
    assert not any(r.plan_note.startswith("exploring") for r in second)
    report = json.loads((tmp_path / "second" / "online.json").read_text())
    assert report["1"]["remembered"] or report["1"]["ms_per_token"]
    assert outputs(second) == outputs(first)
