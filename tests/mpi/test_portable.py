"""The portable engine (device.kernels=portable: models/engine.py) under real mpirun: every method
at batch 1 and 4 commits AR's tokens, its slots' rows in one forward per step."""

from __future__ import annotations

import pytest
from conftest import assert_all_equal_ar, launch_ok

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

METHODS = ("ar", "sd", "pipespec")


@pytest.mark.parametrize(("hier", "ranks"), [("tiny", 3), ("smollm2_suffix", 2)])
def test_portable_engine_every_method_and_batch_equals_ar(tmp_path, hier, ranks):
    recs = launch_ok(
        ranks,
        [f"hierarchy={hier}", "device.kernels=portable", "run.mode=benchmark", "run.methods=[ar,sd,pipespec]",
         "run.batch_sizes=[1,4]", "decode.max_new_tokens=24", "dataset.n_prompts=4", "run.warmup_prompts=0"],
        tmp_path,
        timeout=600,
    )  # fmt: skip
    assert_all_equal_ar(recs, {(m, b) for m in METHODS for b in (1, 4)})
    logs = "".join(p.read_text() for p in tmp_path.glob("rank*.log"))
    assert logs.count(": portable engine on cpu") == (3 if hier == "tiny" else 1), "every model stage"
    batched = [r for r in recs if r["method"] == "pipespec" and r["batch_size"] == 4]
    assert sum(r["stages"][-1]["tokens_accepted"] for r in batched) > 0  # verified, batched
