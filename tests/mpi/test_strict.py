"""The protocol under NCCL's rules (transport.kind=strict: comm/strict.py) through real mpirun:
sampled PipeSpec follows the target's distribution at batch 1 and 4 (batched slots share one link
per pair, the slot in each message: comm/mux.py); anything NCCL would refuse or break on would
have been an error here. (Greedy AR, SD and PipeSpec over it commit the same tokens: the
``strict-*`` cases of tests/mpi/cases.py.)"""

from __future__ import annotations

import pytest
from sampling_stats import chi_square, exact_joint
from test_sampling import sample_pairs

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


# batch 1 in the long tier: batch 4 crosses the same rules and the shared link (comm/mux.py)
@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.long), 4])
def test_samples_over_strict_follow_the_target(tmp_path, batch):
    """Leviathan sampling: every proposal carries its distribution through the strict links."""
    joint = exact_joint(1.0, 4, 1.0)
    extra = ("transport.kind=strict", f"decode.batch_size={batch}", "decode.policy=static")
    pairs = sample_pairs(tmp_path, "tiny", 3, 1.0, 4, 1.0, "leviathan", extra)
    stat, crit = chi_square(pairs, joint)
    assert stat < crit, f"chi2 {stat:.1f} >= {crit:.1f}: samples do not follow the target"
