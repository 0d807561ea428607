"""The planner: inputs from a config, the search space, the ranking and the Hydra overrides;
the paper's setting predicted as the simulator predicts it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.plan import cli, sources
from pipespec_mpi.plan.options import Grid, Option
from pipespec_mpi.plan.realize import overrides
from pipespec_mpi.plan.search import search

CONFIG = """
hierarchy: tiny
target: tiny-target-4L
latency_ms: 0.1
models:
  tiny-draft-1L: {forward_ms: {1: 1.0, 16: 1.5}, overhead_ms: 0.05}
  tiny-mid-3L: {forward_ms: {1: 3.0, 16: 4.0}}
  tiny-target-4L: {forward_ms: {1: 10.0, 16: 12.0}}
acceptance:
  tiny-draft-1L -> tiny-mid-3L: 0.8
  tiny-mid-3L -> tiny-target-4L: 0.9
"""


@pytest.fixture
def inputs(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(CONFIG)
    return sources.load_plan_config(path)


def test_config_is_read(inputs):
    assert inputs.target == "tiny-target-4L"
    assert inputs.models["tiny-draft-1L"].forward_s(16) == pytest.approx(1.5e-3)
    assert inputs.rates[("tiny-mid-3L", "tiny-target-4L")] == 0.9
    assert inputs.latency_s == pytest.approx(1e-4)
    assert inputs.stage_defs is not None and "tiny-mid-3L" in inputs.stage_defs  # conf/hierarchy/tiny.yaml


def test_search_space_needs_pair_rates(inputs):
    found = {m for m, _ in sources.hierarchies(inputs, 3, transitive=False)}
    assert ("tiny-target-4L",) in found
    assert ("tiny-mid-3L", "tiny-target-4L") in found
    assert ("tiny-draft-1L", "tiny-mid-3L", "tiny-target-4L") in found
    assert ("tiny-draft-1L", "tiny-target-4L") not in found  # no rate for that pair
    assert ("tiny-mid-3L", "tiny-draft-1L", "tiny-target-4L") not in found
    rates = dict(sources.hierarchies(inputs, 3, transitive=True))
    assert rates[("tiny-draft-1L", "tiny-target-4L")] == (pytest.approx(0.72),)


def test_every_method_gets_a_best_configuration(inputs):
    grid = Grid(lookaheads=(0, 2), sd_windows=(2, 4))
    found = search(
        sources.RateSource(inputs, seeds=(0,)), DecodeConfig(max_new_tokens=48, policy="static"), grid, 3
    )
    best = found.best(2)
    assert best["ar"][0].speedup == 1.0
    assert best["ar"][0].ms_per_token == pytest.approx(10.0)
    for m in ("sd", "pipespec"):
        assert best[m], m
        assert best[m][0].ms_per_token <= best[m][-1].ms_per_token
        assert best[m][0].speedup == pytest.approx(best["ar"][0].ms_per_token / best[m][0].ms_per_token)


def test_overrides_are_hydra_ready(inputs):
    c = Option("pipespec", ("tiny-draft-1L", "tiny-mid-3L", "tiny-target-4L"), 2, 5.0, 2.0)
    assert overrides(c, inputs) == "hierarchy=tiny method=pipespec decode.lookahead=2"
    c = Option("sd", ("tiny-mid-3L", "tiny-target-4L"), 4, 5.0, 2.0)
    o = overrides(c, inputs)  # SD's window is decode.sd_window
    assert o.startswith("hierarchy=tiny method=sd decode.sd_window=4 'hierarchy.stages=[{name: tiny-mid-3L")
    assert "layers: 3" in o and "noise: 0.05" in o and o.endswith("}]'")
    assert "flat_linear" not in o  # only what differs from a stage's defaults


def test_overrides_name_a_matching_preset():
    inp = sources.PlanInputs(models={}, rates={}, target="smollm2-135m", hierarchy="smollm2",
                          stage_defs=sources.stage_defs_of("smollm2"))  # fmt: skip
    c = Option("pipespec", ("smollm2-135m-w8", "smollm2-135m"), 0, 1.0, 1.0)
    assert overrides(c, inp).startswith("hierarchy=smollm2_w8 ")


def test_overrides_remap_copy_of():
    rename = {"smollm2-135m-w8": "my-w8"}  # so that the candidate matches no preset
    defs = {
        rename.get(k, k): replace(v, name=rename.get(k, k))
        for k, v in sources.stage_defs_of("smollm2").items()
    }
    inp = sources.PlanInputs(models={}, rates={}, target="smollm2-135m", hierarchy="smollm2", stage_defs=defs)
    c = Option("pipespec", ("my-w8", "smollm2-135m"), 0, 1.0, 1.0)
    o = overrides(c, inp)
    assert "copy_of: 1" in o and "prompt-lookup" not in o


def test_cli_json(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({
        "models": {"d": {"forward_ms": 1.0}, "t": {"forward_ms": {"1": 10, "8": 11}}},
        "acceptance": {"d -> t": 0.9},
    }))  # fmt: skip
    argv = ["--config", str(path), "--json", "decode.max_new_tokens=32", "--seeds", "1",
            "--lookaheads", "0,2", "--sd-windows", "2,4", "--top", "1"]  # fmt: skip
    assert cli.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["ar", "sd", "pipespec"]
    assert rows[0]["models"] == ["t"]  # the slowest model is the target by default
    assert all(r["overrides"].startswith("method=") for r in rows)
    assert cli.main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert cli.main(["--config", str(path), "sampling.temperature=1"]) == 2  # not the planner's key


def test_the_planner_predicts_the_paper_setting_as_the_simulator_does():
    """``pipespec-plan --preset paper`` and ``pipespec-simulate --preset paper`` print the same
    ms/token for every row of the paper's table: one prediction (simulate/paper.py paper_ms)."""
    from pipespec_mpi.simulate.paper import (
        PAPER_PIPESPEC_LOOKAHEAD,
        PAPER_SD_WINDOW,
        PaperSetting,
        paper_rows,
    )

    setting = PaperSetting(seeds=(0,))
    rows = paper_rows(setting)
    decode = DecodeConfig(max_new_tokens=setting.n_tokens, max_run_ahead=setting.max_run_ahead,
                          max_verify=setting.max_verify, policy="static")  # fmt: skip
    grid = Grid(lookaheads=(PAPER_PIPESPEC_LOOKAHEAD,), sd_windows=(PAPER_SD_WINDOW,))
    found = search(sources.RateSource(sources.paper_inputs(), seeds=setting.seeds), decode, grid, 3)
    got = {(o.method, o.pipeline): o.ms_per_token for o in found.options if o.policy == "static"}
    assert len(rows) == 7
    for r in rows:
        assert got[(r["method"], tuple(r["models"]))] == pytest.approx(r["ms_per_token"], rel=1e-9), r
