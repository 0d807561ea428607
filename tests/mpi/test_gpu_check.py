"""bench/gpu_check.sh's CPU mode, as CI runs it so that the GPU acceptance run cannot rot: the same
steps (env, profile, AR/SD/PipeSpec through mpirun at two batch sizes over the strict transport,
the outputs' check, the prediction, the table), and the checks of bench/gpu_check.py shown to fail
where they should."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipespec_mpi.analysis.ties import top2_gap
from pipespec_mpi.models.shapes import random_llama

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": sys.executable, "GPU_BUNDLE": str(out / "no-bundle"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # fmt: skip
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--cpu", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "every check passed" in proc.stdout
    return out


def test_the_cpu_mode_runs_every_step_and_checks_the_outputs(cpu_run):
    profile = json.loads((cpu_run / "profile.json").read_text())
    assert set(profile["models"]) == {"toy"} and profile["models"]["toy"]["verify_s"]["16"] > 0
    ties = json.loads((cpu_run / "random_toy" / "ties.json").read_text())
    # every method at batch 1 and 4, against AR at batch 1: 4 prompts x 5 runs, exactly (a CPU)
    assert ties == {"compared": 20, "epsilon": None, "ok": True, "divergences": []}
    table = (cpu_run / "results.md").read_text()
    for method, batch in (("ar", 1), ("sd", 1), ("pipespec", 1), ("ar", 4), ("pipespec", 4)):
        assert f"| random_toy | {method} | {batch} |" in table
    assert "1B -> 8B -> 70B" in (cpu_run / "predicted.txt").read_text()


def test_the_job_check_fails_where_the_run_is_not_what_it_says(cpu_run, capsys):
    """An eager run is refused where compiled forwards were asked for; the near-tie rule rescores
    with the job's own target, rebuilt from the run's config (its random weights from their seed)."""
    gc = gpu_check_module()
    run = cpu_run / "random_toy"
    assert gc.job(run, epsilon=None, expect_compiled=True) == 1
    assert "NOT compiled" in capsys.readouterr().out
    assert gc.job(run, epsilon=1e-3, expect_compiled=False) == 0
    gap_after = gc.target_gaps(run)
    context = [256, 104, 105, 33]
    target = random_llama("toy", "cpu", torch.float64, seed=1234 * 1000 + 2)  # hierarchy.tiny.seed, stage 2
    with torch.inference_mode():
        expect = top2_gap(target(torch.tensor([context])).logits[0, -1].tolist())
    assert gap_after(context) == pytest.approx(expect, rel=1e-6)  # (the engine returns float32 logits)
