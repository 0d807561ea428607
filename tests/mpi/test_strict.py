"""The protocol under NCCL's rules (transport.kind=strict: comm/strict.py) through real mpirun:
greedy AR, SD and PipeSpec commit the same tokens at batch 1 and 4 (batched slots share one link
per pair, the slot in each message: comm/mux.py), and sampled PipeSpec follows the target's
distribution; anything NCCL would refuse or break on would have been an error here."""

from __future__ import annotations

import pytest
from conftest import assert_all_equal_ar, launch_ok
from sampling_stats import chi_square, exact_joint
from test_sampling import sample_pairs

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

METHODS = ("ar", "sd", "pipespec")


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_over_strict_equals_ar(tmp_path, batch):
    recs = launch_ok(
        3,
        ["hierarchy=tiny", "transport.kind=strict", "run.mode=benchmark", "run.methods=[ar,sd,pipespec]",
         f"run.batch_sizes=[{batch}]", "decode.max_new_tokens=24", "dataset.n_prompts=6"],
        tmp_path,
    )  # fmt: skip
    assert_all_equal_ar(recs, {(m, batch) for m in METHODS})
    ps = [r for r in recs if r["method"] == "pipespec"]
    assert sum(r["stages"][-1]["tokens_accepted"] for r in ps) > 0  # proposals crossed the links
    assert all(r["transport"] == "strict" for r in recs)


@pytest.mark.parametrize("batch", [1, 4])
def test_samples_over_strict_follow_the_target(tmp_path, batch):
    """Leviathan sampling: every proposal carries its distribution through the strict links."""
    joint = exact_joint(1.0, 4, 1.0)
    extra = ("transport.kind=strict", f"decode.batch_size={batch}", "decode.policy=static")
    pairs = sample_pairs(tmp_path, "tiny", 3, 1.0, 4, 1.0, "leviathan", extra)
    stat, crit = chi_square(pairs, joint)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}: samples do not follow the target"
