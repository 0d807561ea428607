"""Batched decoding under real mpirun (decode.batch_size, run.batch_sizes): every prompt's greedy
output equals AR's at batch 1 for ar, sd and pipespec at every batch size, the slots' links stay
apart on both CPU transports, and benchmark.json reports each method per batch size.

The tiny hierarchy is float64 (batched and one-row forwards agree there); the embedded SmolLM2
runs float32 through the flat kernel, where a batched row is bitwise its own forward, so its
equality is exact too.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import assert_all_equal_ar, launch_ok

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


@pytest.mark.parametrize("hier", ["tiny", "tiny_suffix"])
def test_every_method_at_every_batch_size_equals_ar(tmp_path, hier):
    sizes, methods = [1, 2, 4], ["ar", "sd", "pipespec"]
    recs = launch_ok(
        3,
        [f"hierarchy={hier}", "run.mode=benchmark", "run.batch_sizes=[1,2,4]", "decode.lookahead=1",
         "decode.max_new_tokens=24", "dataset.n_prompts=6", "decode.policy=static", "tuning=cpu_few_cores"],
        tmp_path,
    )  # fmt: skip
    assert_all_equal_ar(recs, {(m, b) for m in methods for b in sizes})
    slots = {(r["batch_size"], r["slot"]) for r in recs if not r["warmup"]}
    assert slots == {(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)}
    bench = json.loads((tmp_path / "benchmark.json").read_text())
    assert list(bench) == [
        "ar",
        "sd",
        "pipespec",
        "ar@b2",
        "sd@b2",
        "pipespec@b2",
        "ar@b4",
        "sd@b4",
        "pipespec@b4",
    ]
    for key, row in bench.items():
        assert row["n_prompts"] == 6 and row["n_tokens"] == 6 * 24
        assert row["tokens_per_s"] == pytest.approx(row["n_tokens"] / row["wall_s"])
        assert set(row["sequence_ms_per_token"]) == {"p50", "p90", "mean"}
        b = row["batch_size"]
        if b > 1:  # sequences overlapped: the phase took less than their walls summed
            rs = [
                r
                for r in recs
                if not r["warmup"] and r["batch_size"] == b and key.startswith(r["method"] + "@")
            ]
            assert row["wall_s"] < sum(r["wall_s"] for r in rs)
        ar = bench["ar" if b == 1 else f"ar@b{b}"]
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / ar["tokens_per_s"])
    ps = [r for r in recs if r["method"] == "pipespec" and r["batch_size"] == 4]
    assert sum(r["stages"][-1]["tokens_accepted"] for r in ps) > 0  # verification happened, batched


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
        got = [st["cpus"] for st in r["stages"]]
        want = [None] * 3 if r["batch_size"] == 1 else [[two[0]], [two[0]], [two[1]]]
        alone = r["method"] == "ar" or dtype == "float64"
        if alone:
            want[-1] = None
        assert got == want, (r["method"], r["batch_size"], got)
        assert [st["threads"] for st in r["stages"]] == [1, 1, 2 if alone else 1], r["method"]


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
    assert len(recs) == 5 and {r["slot"] for r in recs} == {0, 1, 2}
    for r in recs:
        assert (r["finish_reason"], r["n_new_tokens"] == 16) in {("length", True), ("eos", False)}, r
    assert sum(r["stages"][-1]["tokens_accepted"] for r in recs) > 0


@pytest.mark.long
def test_the_embedded_model_batched_is_lossless(tmp_path):
    """The default hierarchy (lookup -> int8 copy -> SmolLM2): batched rows are bitwise their own
    forward, so ar, sd and pipespec at batch 3 equal AR at batch 1 exactly."""
    recs = launch_ok(
        3,
        ["run.mode=benchmark", "run.batch_sizes=[1,3]", "run.warmup_prompts=0", "decode.max_new_tokens=20",
         "dataset.n_prompts=3"],
        tmp_path,
        timeout=600,
    )  # fmt: skip
    assert_all_equal_ar(recs, {(m, b) for m in ("ar", "sd", "pipespec") for b in (1, 3)})
