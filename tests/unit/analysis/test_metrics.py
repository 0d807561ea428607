import random
import statistics
import weakref
from collections import Counter
from dataclasses import replace

import pytest

from pipespec_mpi.analysis.metrics import (
    PERCENTILES,
    acceptance,
    acceptance_of_counts,
    benchmark_table,
    decoding_wall_s,
    latency_percentiles_ms,
    summarize,
    token_latencies,
)
from pipespec_mpi.records import PairAcceptance, Record, group_key
from pipespec_mpi.stage.stats import StageStats

from ..test_records import make_record


def test_acceptance_on_a_known_trace():
    a = acceptance([[3, 3], [3, 1], [2, 0], [1, 1]])
    assert a.verifications == 4 and a.accepted == 5 and a.proposed == 9
    assert a.mean_acceptance_length == pytest.approx(1 + 5 / 4)
    # position 0 accepted in 3 of 4; position 1 in 1 of 3; position 2 in 1 of 2
    assert a.per_position_acceptance == pytest.approx([3 / 4, 1 / 3, 1 / 2])
    assert a.accepted_histogram == [1, 2, 0, 1]


def test_empty_trace():
    a = acceptance([])
    assert a.verifications == 0 and a.mean_acceptance_length == 0.0


def test_token_latencies_spread_commits():
    assert token_latencies([[0.1, 1], [0.4, 4]]) == pytest.approx([0.1, 0.1, 0.1, 0.1])


def _hand_written_percentile(values, q):
    """The percentile summary.json used before ``statistics.quantiles``: linear interpolation
    between the closest ranks."""
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def test_latency_percentiles():
    assert latency_percentiles_ms([0.001, 0.002, 0.003, 0.004])["p50"] == pytest.approx(2.5)
    assert latency_percentiles_ms([]) == {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    assert latency_percentiles_ms([0.003]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}
    # 0, 1, ..., 100 ms: percentile q is q ms
    steps = latency_percentiles_ms([k / 1000 for k in range(101)])
    assert steps == {f"p{q}": pytest.approx(q, rel=1e-12) for q in PERCENTILES}
    # the same numbers as the hand-written formula it replaces, up to floating-point rounding
    # (the two evaluate the interpolation in a different order: at most ~1e-14 apart)
    rng = random.Random(0)
    for _ in range(2000):
        xs = [rng.expovariate(50) for _ in range(rng.randint(2, 300))]
        got = latency_percentiles_ms(xs)
        for q in PERCENTILES:
            assert got[f"p{q}"] == pytest.approx(1000 * _hand_written_percentile(xs, q), rel=1e-12, abs=0)
        assert statistics.median(xs) == pytest.approx(got["p50"] / 1000, rel=1e-12)


def _rec(method, pid, n, wall, trace=()):
    def stage(s, tr):
        return StageStats(stage=s, rank=s, model="m", forward_calls=1, busy_s=wall / 2,
                          verify_trace=list(tr), commit_times=[[wall, n]])  # fmt: skip

    return Record(prompt_id=pid, replica=0, method=method, warmup=False, seq=0, prompt_ids=[1],
                  output_ids=[2] * n, text="", n_new_tokens=n, finish_reason="length", wall_s=wall,
                  ms_per_token=1000 * wall / n, ttft_s=0.01, window=1, max_new_tokens=n,
                  transport="mpi", hierarchy="h", models=["m", "m"],
                  stages=[stage(0, []), stage(1, trace)])  # fmt: skip


def test_summary_and_benchmark_speedups():
    recs = [_rec("ar", "a", 10, 1.0), _rec("ar", "b", 10, 1.0),
            _rec("pipespec", "a", 10, 0.5, [[2, 1]]), _rec("pipespec", "b", 10, 0.25, [[2, 2]])]  # fmt: skip
    s = summarize(recs)
    assert s["ar"].ms_per_token == pytest.approx(100.0)
    assert s["pipespec"].ms_per_token == pytest.approx(37.5)
    assert s["pipespec"].mean_accepted_per_verification["0->1"] == pytest.approx(1.5)
    b = benchmark_table(recs, ["ar", "pipespec"])
    assert b["pipespec"].speedup == pytest.approx(100 / 37.5)
    assert b["pipespec"].speedup_per_prompt.median == pytest.approx(3.0)
    assert b["pipespec"].speedup_per_prompt.min == pytest.approx(2.0)
    assert b["pipespec"].speedup_per_prompt.max == pytest.approx(4.0)
    # a method whose records made no token (each hit EOS at once) has no speedup, and no error
    empty = [replace(r, n_new_tokens=0, output_ids=[], ms_per_token=0.0) for r in recs[2:]]
    b = benchmark_table(recs[:2] + empty, ["ar", "pipespec"])
    assert b["pipespec"].n_tokens == 0 and b["pipespec"].speedup is None


def test_energy_integration_and_per_token_accounting():
    from pipespec_mpi.run.gpu_monitor import integrate_energy

    assert integrate_energy([(0.0, 100.0), (1.0, 200.0), (2.0, 200.0)]) == pytest.approx(350.0)
    r = _rec("sd", "a", 10, 1.0)
    r.stages[0].rank, r.stages[1].rank = 0, 1
    r.stages[0].gpus = [{"device": 0, "energy_j": 30.0}]
    r.stages[1].gpus = [{"device": 1, "energy_j": 50.0}]
    s = summarize([r])["sd"]
    assert s.energy_j_per_token_system == pytest.approx(8.0)
    assert s.energy_j_per_token_per_gpu == pytest.approx(4.0)
    assert s.n_gpus_measured == 2
    cpu = summarize([_rec("ar", "a", 10, 1.0)])["ar"]
    assert cpu.energy_j_per_token_system is None
    assert "energy_j_per_token_system" not in cpu.to_json()  # absent from summary.json on CPUs


def _batched(method, pid, n, t0, wall, b, replica=0, phase=None):
    r = _rec(method, pid, n, wall)
    r.batch_size, r.replica, r.phase = b, replica, phase
    r.stages[-1].t0_perf_counter = t0
    return r


def test_phases_of_one_batch_size_that_ran_apart_are_timed_each_over_its_own_span():
    """``run.batch_sizes=[4,16,4]``: the two batch-4 phases' records form one group; its time is
    each phase's span, not the stretch from the first's start to the second's end (the batch-16
    phase between them is not batch 4's time)."""
    recs = [
        _batched("ar", "a", 10, 100.0, 1.0, 4, phase=2), _batched("ar", "b", 10, 100.5, 1.0, 4, phase=2),
        _batched("ar", "a", 10, 102.0, 5.0, 16, phase=5),
        _batched("ar", "a", 10, 110.0, 1.0, 4, phase=8), _batched("ar", "b", 10, 110.0, 0.5, 4, phase=8),
    ]  # fmt: skip
    s = summarize(recs)
    assert s["ar@b4"].wall_s == pytest.approx(1.5 + 1.0)
    assert s["ar@b16"].wall_s == pytest.approx(5.0)
    # records written before the phase was: one span per replica, as then
    for r in recs:
        r.phase = None
    assert summarize(recs)["ar@b4"].wall_s == pytest.approx(11.0)


def test_batched_throughput_is_over_the_phase_span_and_compared_at_the_same_batch_size():
    """Batched sequences overlap: a phase's decoding time is its span (first start to last end
    on the leader's clock), per replica, summed; the speedup is over AR at the same batch size."""
    recs = [
        _rec("ar", "a", 10, 1.0), _rec("ar", "b", 10, 1.0),  # batch 1: 20 tokens in 2 s
        # batch 2, replica 0: two overlapping sequences then one more: 30 tokens in 100.0..101.5 s
        _batched("ar", "a", 10, 100.0, 1.0, 2), _batched("ar", "b", 10, 100.1, 0.9, 2),
        _batched("ar", "c", 10, 101.0, 0.5, 2),
        # batch 2, replica 1 (its own clock): 10 tokens in 0.5 s
        _batched("ar", "d", 10, 7.0, 0.5, 2, replica=1),
        _batched("pipespec", "a", 10, 200.0, 0.5, 2), _batched("pipespec", "b", 10, 200.0, 0.25, 2),
    ]  # fmt: skip
    s = summarize(recs)
    assert set(s) == {"ar", "ar@b2", "pipespec@b2"}
    assert s["ar"].wall_s == pytest.approx(2.0) and s["ar"].batch_size == 1
    assert s["ar@b2"].wall_s == pytest.approx(1.5 + 0.5) and s["ar@b2"].tokens_per_s == pytest.approx(20.0)
    assert s["ar@b2"].sequence_ms_per_token["p50"] == pytest.approx(70.0)  # 100 90 50 50 ms
    b = benchmark_table(recs, ["ar", "pipespec"])
    assert list(b) == ["ar", "ar@b2", "pipespec@b2"]
    assert b["pipespec@b2"].batch_size == 2
    assert b["pipespec@b2"].speedup == pytest.approx(40.0 / 20.0)  # 20 tokens in 0.5 s vs ar@b2
    assert b["pipespec@b2"].speedup_per_prompt.n == 2  # prompts a and b, at batch 2 only
    pp = b["pipespec@b2"].speedup_per_prompt
    assert (pp.min, pp.max) == (pytest.approx(100 / 50), pytest.approx(90 / 25))  # a, b at batch 2


def test_proposals_and_tokens_per_forward_and_the_drafter_per_source():
    recs = [_rec("pipespec", p, 10, 0.5) for p in ("a", "b")]
    for r, (verifs, own, gen) in zip(recs, [(3, 1, 9), (1, 3, 5)]):
        st = r.stages[1]
        st.forward_calls, st.verifications, st.own_steps, st.tokens_generated = verifs + own, verifs, own, gen
    recs[0].stages[0].drafter = {
        "proposals": {"sequence": 2, "job": 1},
        "misses": 3,
        "proposed": {"sequence": 6, "job": 4},
        "accepted": {"sequence": 5, "job": 1},
    }
    recs[1].stages[0].drafter = {"proposals": {"sequence": 2}, "proposed": {"sequence": 2},
                                 "accepted": {"sequence": 1}}  # fmt: skip
    s = summarize(recs)["pipespec"].stages
    assert s[1].proposals_per_forward == pytest.approx(4 / 8)
    assert s[1].tokens_per_forward == pytest.approx(14 / 8)
    assert (s[1].verifications, s[1].own_steps) == (4, 4)
    assert s[0].drafter == {
        "job": {"proposals": 1, "proposed": 4, "accepted": 1, "mean_accepted": 1.0},
        "sequence": {"proposals": 4, "proposed": 8, "accepted": 6, "mean_accepted": 1.5},
    }
    assert s[1].drafter == {}  # a model stage keeps no drafter counters


def _acceptance_of_the_whole_trace(trace):
    """``acceptance`` as it was computed before the counts: over the trace itself."""
    verifs, accepted, proposed = len(trace), sum(a for _, a in trace), sum(n for n, _ in trace)
    longest = max((n for n, _ in trace), default=0)
    per_pos = []
    for j in range(longest):
        eligible = [a for n, a in trace if n > j]
        per_pos.append(sum(1 for a in eligible if a > j) / len(eligible) if eligible else 0.0)
    hist = [0] * (longest + 1)
    for _, a in trace:
        hist[a] += 1
    return PairAcceptance(
        verifications=verifs, proposed=proposed, accepted=accepted,
        mean_accepted=accepted / verifs if verifs else 0.0,
        mean_acceptance_length=1 + accepted / verifs if verifs else 0.0,
        acceptance_rate=accepted / proposed if proposed else 0.0,
        per_position_acceptance=per_pos, accepted_histogram=hist,
    )  # fmt: skip


def test_acceptance_from_counts_is_the_acceptance_of_the_trace():
    rng = random.Random(7)
    for _ in range(200):
        window = rng.randint(1, 8)
        trace = [[n, rng.randint(0, n)] for n in (rng.randint(1, window) for _ in range(rng.randint(0, 300)))]
        want = _acceptance_of_the_whole_trace(trace)
        assert acceptance(trace) == want  # exact: the same ints, the same divisions
        assert acceptance_of_counts(Counter((n, a) for n, a in trace)) == want
    assert acceptance_of_counts(Counter()) == _acceptance_of_the_whole_trace([])
    assert acceptance_of_counts(Counter({(3, 1): 2, (2, 2): 0})) == acceptance([[3, 1], [3, 1]])


_MIX = [(m, b, rep, t) for m in ("ar", "pipespec") for b in (1, 4) for rep in (0, 1) for t in (0.0, 0.7)]


def _mixed_records(seed=0, n=80):
    """Records of AR and PipeSpec at batch 1 and 4 on two replicas, greedy and sampled (every
    combination in turn), warm-ups among them, with random walls, start times, commit times and
    verification traces."""
    rng = random.Random(seed)
    recs = []
    for i in range(n):
        method, b, replica, temp = _MIX[i % len(_MIX)]
        r = make_record(
            method, f"p{rng.randint(0, 9)}", rng.uniform(0.05, 2.0), rng.randint(1, 4), replica=replica,
            batch_size=b, slot=rng.randrange(b), warmup=i < len(_MIX) and rng.random() < 0.3,
            temperature=temp, sample_idx=rng.randint(0, 2) if temp else 0, seq=i, ttft_s=rng.uniform(0, 0.2),
        )  # fmt: skip
        last = r.stages[-1]
        last.t0_perf_counter = rng.uniform(0, 50)
        times = sorted(rng.uniform(0, r.wall_s) for _ in range(r.n_new_tokens))
        last.commit_times = [[t, k + 1] for k, t in enumerate(times)]
        proposed = [rng.randint(1, 5) for _ in range(rng.randint(0, 9))]
        last.verify_trace = [[k, rng.randint(0, k)] for k in proposed]
        for st in r.stages:
            st.busy_s, st.discarded_s, st.threads = rng.uniform(0, r.wall_s), rng.uniform(0, 0.1), 2
            st.gpus = [{"device": d, "energy_j": rng.uniform(0, 9)} for d in range(rng.randint(0, 2))]
        recs.append(r)
    return recs


def _json(results):
    return {k: v.to_json() for k, v in results.items()}


def test_summary_and_benchmark_over_a_generator_are_those_over_the_list():
    recs = _mixed_records()
    measured = [r for r in recs if not r.warmup]
    assert any(r.warmup for r in recs)
    assert {(r.method, r.batch_size, r.replica, r.temperature) for r in measured} == set(_MIX)
    summary = summarize(recs)
    assert set(summary) == {"ar", "pipespec", "ar@b4", "pipespec@b4"}
    assert _json(summarize(r for r in recs)) == _json(summary)
    methods = ["ar", "sd", "pipespec"]
    bench = benchmark_table(recs, methods)
    assert list(bench) == ["ar", "pipespec", "ar@b4", "pipespec@b4"]
    assert _json(benchmark_table((r for r in recs), methods)) == _json(bench)
    # the same numbers as the per-record definitions over the group's records as a list
    for key, s in summary.items():
        mine = [r for r in measured if group_key(r.method, r.batch_size) == key]
        assert s.wall_s == decoding_wall_s(mine)
        if s.batch_size == 1:
            assert s.wall_s == sum(r.wall_s for r in mine)
        assert s.acceptance["0->1"] == acceptance([t for r in mine for t in r.stages[1].verify_trace])
        lat = [x for r in mine for x in token_latencies(r.stages[-1].commit_times)]
        assert s.token_latency_ms == latency_percentiles_ms(lat)
        assert s.ttft_s_mean == statistics.fmean(r.ttft_s for r in mine)
        busy = [sum(r.stages[k].busy_s + r.stages[k].prefill_s for r in mine) / s.wall_s for k in (0, 1)]
        assert [st.busy_fraction for st in s.stages] == busy


def test_summarize_keeps_no_record():
    """summarize and benchmark_table hold a record only while they consume it: when the next one
    is read, every earlier one is gone (as for a generator reading results.jsonl)."""
    lines = [r.to_json() for r in _mixed_records(seed=1, n=60)]
    live: set[int] = set()

    def read():
        for i, line in enumerate(lines):
            assert live <= {i - 1}, f"records {sorted(live)} alive when reading record {i}"
            r = Record.from_json(line)
            live.add(i)
            weakref.finalize(r, live.discard, i)
            yield r
            del r

    from_list = [Record.from_json(line) for line in lines]
    assert _json(summarize(read())) == _json(summarize(from_list))
    assert not live
    methods = ["ar", "pipespec"]
    assert _json(benchmark_table(read(), methods)) == _json(benchmark_table(from_list, methods))
    assert not live


def test_group_keys_round_trip_and_entries_name_their_group():
    from pipespec_mpi.records import find_entry, parse_group_key

    assert group_key("pipespec", 1) == "pipespec" and group_key("sd", 4) == "sd@b4"
    for method in ("ar", "sd", "pipespec"):
        for b in (1, 2, 16):
            assert parse_group_key(group_key(method, b)) == (method, b)
    recs = [replace(_rec(m, f"p{i}", 8, 0.1 * (i + 1)), batch_size=b) for m in ("ar", "pipespec")
            for b in (1, 4) for i in range(2)]  # fmt: skip
    for doc in (summarize(recs), benchmark_table(recs, ["ar", "pipespec"])):
        assert all((e.method, e.batch_size) == parse_group_key(k) for k, e in doc.items())
        assert find_entry(doc, "pipespec", 4) is doc["pipespec@b4"] and find_entry(doc, "sd") is None


def _cpu(st, cpu0, cpu1, t0, t1):
    st.cpu_start_s, st.cpu_end_s, st.t0_perf_counter, st.t1_perf_counter = cpu0, cpu1, t0, t1


def test_cores_busy_per_stage_are_its_cpu_time_over_its_time_on_the_records():
    """Batch 1: per record (another method's records ran between them, on the same ranks);
    batched: over each phase, from its first job's start on the rank to its last handoff, since
    the slots' jobs overlap (summed per record, a phase of 4 slots would count its CPU 4 times)."""
    a, b = _rec("pipespec", "a", 10, 1.0), _rec("pipespec", "b", 10, 1.0)
    _cpu(a.stages[0], 10.0, 10.1, 50.0, 51.0)  # the drafter: 0.1 s of CPU in 1 s
    _cpu(b.stages[0], 12.0, 12.3, 60.0, 61.0)  # 0.3 s in 1 s (the CPU between them is AR's)
    _cpu(a.stages[1], 5.0, 6.9, 50.0, 51.0)
    _cpu(b.stages[1], 8.0, 9.9, 60.0, 61.0)
    s = summarize([a, b])["pipespec"]
    assert [st.cpu_cores for st in s.stages] == [pytest.approx(0.2), pytest.approx(1.9)]

    ar = _rec("ar", "a", 10, 1.0)  # the drafter has no part in AR: it hands over at once
    _cpu(ar.stages[0], 11.0, 11.0, 52.0, 52.0001)
    _cpu(ar.stages[1], 7.0, 8.0, 52.0, 53.0)
    assert [st.cpu_cores for st in summarize([ar])["ar"].stages] == [None, pytest.approx(1.0)]

    # batched, four slots' jobs overlapping in one phase of 2 s on the drafter's rank
    phase = []
    for i in range(4):
        r = _batched("ar", f"p{i}", 10, 100.0 + 0.5 * i, 0.5, 4, phase=3)
        _cpu(r.stages[0], 20.0 + 0.01 * i, 20.02 + 0.01 * i, 100.0 + 0.5 * i, 100.5 + 0.5 * i)
        _cpu(r.stages[1], 30.0 + i, 31.0 + i, 100.0 + 0.5 * i, 100.5 + 0.5 * i)
        phase.append(r)
    st = summarize(phase)["ar@b4"].stages
    assert st[0].cpu_cores == pytest.approx(0.05 / 2.0)  # 20.00 .. 20.05 over 100.0 .. 102.0
    assert st[1].cpu_cores == pytest.approx(4.0 / 2.0)
    # records from before these fields: no figure
    assert summarize([_rec("ar", "a", 10, 1.0)])["ar"].stages[1].cpu_cores is None


def test_a_slots_handoff_measures_its_own_job_cpu_and_gpu_monitor():
    """``LeaderHandoff.started`` starts the measurements of the job on its slot and ``post`` ends
    them: the rank's CPU time, and the slot's own GPU monitor (a batched slot's is inactive; the
    rank's monitor was started per job by the runner before, and never stopped in batched phases)."""
    import time

    from pipespec_mpi.run.collect import LeaderHandoff
    from pipespec_mpi.run.jobs import Job, Prompt
    from pipespec_mpi.stage.stats import StageOutcome

    class Monitor:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def start(self) -> None:
            self.calls.append("start")

        def stop(self) -> list[dict]:
            self.calls.append("stop")
            return []

    slot_monitor = Monitor()
    handoff = LeaderHandoff(None, 0, 1, gpu_monitor=slot_monitor, on_record=None)
    handoff.started()
    cpu0 = time.process_time()
    while time.process_time() - cpu0 < 0.02:  # some CPU time of this process
        pass
    st = StageStats(stage=0, rank=0, model="m")
    job = Job(seq=1, prompt=Prompt(id="a", ids=[1], position=0), method="ar", warmup=False)
    handoff.post(job, StageOutcome([1], "length", 0.1, st))
    assert slot_monitor.calls == ["start", "stop"]
    assert st.cpu_end_s - st.cpu_start_s >= 0.02 and st.t1_perf_counter > 0.0
