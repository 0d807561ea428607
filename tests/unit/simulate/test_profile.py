"""Forward costs measured by the same code bench/gpu_check.sh runs (simulate/profile.py), read by
``pipespec-simulate --profile``: the paper's hierarchy predicted from a profile of this CPU."""

from __future__ import annotations

import json

import pytest

from pipespec_mpi.simulate import cli
from pipespec_mpi.simulate.profile import MAX_GRAPHS, SHAPES, compile_problems, params, profiles_from
from pipespec_mpi.simulate.profile import main as profile_main


def test_param_counts_are_the_models():
    assert params("1B") == pytest.approx(1.24e9, rel=0.02)
    assert params("8B") == pytest.approx(8.03e9, rel=0.02)
    assert params("70B") == pytest.approx(70.6e9, rel=0.02)


def test_missing_shapes_are_scaled_by_weight_bytes():
    doc = {"models": {"1B": {"params": params("1B"), "verify_s": {"1": 0.01, "16": 0.02},
                             "batch_s": {"1": 0.01, "2": 0.012, "4": 0.016}}}}  # fmt: skip
    profiles, source = profiles_from(doc)
    assert source["1B"] == "measured" and source["70B"].startswith("scaled from 1B x 57.")
    assert profiles["70B"].forward_s(1) == pytest.approx(0.01 * params("70B") / params("1B"))
    assert profiles["1B"].per_sequence_s == pytest.approx(0.002)


@pytest.mark.slow
def test_simulate_reads_a_profile_measured_here(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert profile_main(["--out", str(out), "--models", "135M", "--repeats", "1", "--max-batch", "4",
                         "--context", "64"]) == 0  # fmt: skip
    doc = json.loads(out.read_text())
    m = doc["models"]["135M"]
    assert set(m["verify_s"]) == {"1", "2", "3", "4", "6", "8", "12", "16"} and set(m["batch_s"]) == {
        "1",
        "2",
        "4",
    }
    assert all(s > 0 for s in m["verify_s"].values())
    capsys.readouterr()
    assert cli.main(["--profile", str(out), "--batch-sizes", "1,2", "--json", "--seeds", "1"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert {(r["batch_size"], r["method"]) for r in got["rows"]} >= {(1, "ar"), (2, "pipespec")}
    assert got["models"]["8B"].startswith("scaled from 135M") and SHAPES["135M"]
    ar = next(r for r in got["rows"] if r["method"] == "ar" and r["batch_size"] == 1)
    assert ar["speedup"] == 1.0 and ar["ms_per_token"] > 0


def test_compile_problems_name_what_the_compiled_forward_did_otherwise():
    whole = {"compiled_graphs": 3, "graph_breaks": 0, "cudagraph_skips": 0, "cuda_graphs": True}
    assert compile_problems(whole) == []
    assert compile_problems({"verify_s": {}}) == ["not compiled (profile without --compile)"]
    bad = {**whole, "compiled_graphs": MAX_GRAPHS + 1, "graph_breaks": 2, "cudagraph_skips": 1}
    assert compile_problems(bad) == [
        "2 graph breaks", f"{MAX_GRAPHS + 1} graphs (expected 1..{MAX_GRAPHS})",
        "1 CUDA-graph skips (ran without a captured graph)",
    ]  # fmt: skip
    assert compile_problems({**bad, "cuda_graphs": False, "compiled_graphs": 2, "graph_breaks": 0}) == []
