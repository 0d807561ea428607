"""Batched decoding under real mpirun (decode.batch_size, run.batch_sizes): the batched phases
bind the last stage to a CPU of its own, and the slots' links stay apart on both CPU transports.
(That every method at every batch size equals AR at batch 1, and benchmark.json per batch size:
the case matrix, tests/mpi/cases.py, run by tests/mpi/test_lossless.py.)
"""

from __future__ import annotations

import os

import pytest
from conftest import assert_all_equal_ar, launch_ok

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_batched_phases_bind_the_last_stage_to_a_cpu_of_its_own(tmp_path, dtype):
    """Three ranks on two CPUs (the test binds itself to two; mpirun's ranks inherit them), the
    launcher binding none: each record says where each stage ran. Batch 1 stays as launched
    (``run.cpu_bind=auto``), the batch-2 phase puts the last stage alone on the second CPU and
    the others on the first; AR, where the last stage computes alone, runs it unbound on both
    CPUs' threads at every batch size; outputs equal AR's either way. A float64 target (torch's
    GEMM and SDPA, whose rounding may change with the threads) computes as in AR in every method:
    both CPUs' threads, unbound."""
    home = os.sched_getaffinity(0)
    if len(home) < 2:
        pytest.skip("needs two CPUs")
    two = sorted(home)[:2]
    os.sched_setaffinity(0, two)
    try:
        recs = launch_ok(
            3,
            ["hierarchy=tiny", "run.mode=benchmark", "run.methods=[ar,pipespec]", "run.batch_sizes=[1,2]",
             "decode.max_new_tokens=12", "dataset.n_prompts=3", f"hierarchy.stages.2.dtype={dtype}"],
            tmp_path,
        )  # fmt: skip
    finally:
        os.sched_setaffinity(0, home)
    assert_all_equal_ar(recs, {(m, b) for m in ("ar", "pipespec") for b in (1, 2)})
    for r in recs:
        got = [st.cpus for st in r.stages]
        want = [None] * 3 if r.batch_size == 1 else [[two[0]], [two[0]], [two[1]]]
        alone = r.method == "ar" or dtype == "float64"
        if alone:
            want[-1] = None
        assert got == want, (r.method, r.batch_size, got)
        assert [st.threads for st in r.stages] == [1, 1, 2 if alone else 1], r.method


@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_slots_links_stay_apart_under_leviathan_sampling(tmp_path, transport):
    """Three slots' proposals, each with its distribution, on one pair of ranks: a message read
    by the wrong slot would be dropped or contradict its tokens (a stall, an error or a wrong
    count); every sequence ends at its length or at EOS. The static policy, because the case needs
    proposals on the link: the adaptive one may rightly give the tiny drafts no rows at all."""
    recs = launch_ok(
        3,
        ["hierarchy=tiny", "method=pipespec", "decode.policy=static", "decode.batch_size=3",
         f"transport.kind={transport}", "sampling.temperature=1.0", "decode.max_new_tokens=16",
         "dataset.n_prompts=5", "decode.lookahead=2"],
        tmp_path,
    )  # fmt: skip
    assert len(recs) == 5 and {r.slot for r in recs} == {0, 1, 2}
    for r in recs:
        assert (r.finish_reason, r.n_new_tokens == 16) in {("length", True), ("eos", False)}, r
    assert sum(r.stages[-1].tokens_accepted for r in recs) > 0
