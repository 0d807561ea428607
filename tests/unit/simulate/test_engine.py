"""The discrete-event simulator: cases with known answers, token conservation, calibration."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.records import Record, write_records
from pipespec_mpi.simulate import Acceptance, LatencyProfile, SimConfig, SimResult, simulate
from pipespec_mpi.simulate.cli import main
from pipespec_mpi.simulate.fit import predict_run
from pipespec_mpi.simulate.oracle import TokenOracle, mix64
from pipespec_mpi.simulate.paper import committed_to_trace
from pipespec_mpi.simulate.traces import lookup_trace
from pipespec_mpi.stage.stats import StageStats

MS = 1e-3
DRAFT = LatencyProfile("draft", ((1, 1 * MS),))
TARGET = LatencyProfile("target", ((1, 10 * MS), (2, 12 * MS)))  # 10 ms + 2 ms per extra token
MID = LatencyProfile("mid", ((1, 4 * MS), (2, 5 * MS)))


DECODE_KEYS = ("lookahead", "max_new_tokens", "max_run_ahead", "max_verify")


def cfg(**kw) -> SimConfig:
    """A SimConfig from flat keywords: the stage loop's own settings go to ``decode``."""
    dec = dict(max_new_tokens=100, max_run_ahead=16, max_verify=16, sd_window=None, policy="static")
    dec.update({k: kw.pop(k) for k in DECODE_KEYS if k in kw})
    return SimConfig(**{"include_prefill": False, **kw, "decode": DecodeConfig(**dec)})


# ------------------------------------------------------------------------------ known answers
def test_one_stage_ar_is_forward_plus_overhead():
    prof = replace(TARGET, overhead_s=1 * MS, prefill_base_s=50 * MS)
    r = simulate([prof], (), cfg(method="ar", max_new_tokens=40))
    assert r.n_tokens == 40 and r.lossless
    assert r.wall_s == pytest.approx(40 * 11 * MS)
    r = simulate([prof], (), cfg(method="ar", max_new_tokens=40, include_prefill=True))
    assert r.wall_s == pytest.approx(50 * MS + 40 * 11 * MS)


def test_ar_ignores_the_drafters():
    r = simulate([DRAFT, TARGET], [0.5], cfg(method="ar", max_new_tokens=20))
    assert r.ms_per_token == pytest.approx(10.0)
    assert r.stages[0].forward_calls == 0


@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_sd_alpha_one_commits_whole_windows(gamma):
    # every draft accepted: a cycle is gamma drafts then one verification, gamma + 1 tokens
    n = 20 * (gamma + 1)
    r = simulate([DRAFT, TARGET], [1.0], cfg(method="sd", lookahead=gamma, max_new_tokens=n))
    cycle = gamma * 1 * MS + TARGET.forward_s(gamma)
    assert r.wall_s == pytest.approx(20 * cycle)
    assert r.stages[1].verify_trace == [[gamma, gamma]] * 20
    assert r.stages[0].rollbacks == 0 and r.lossless


def test_sd_alpha_zero_commits_one_token_per_window():
    r = simulate([DRAFT, TARGET], [0.0], cfg(method="sd", lookahead=4, max_new_tokens=30))
    assert r.stages[1].tokens_accepted == 0
    # one token per window of min(4, budget - 1) drafts; the last token is a step of its own
    windows = [min(4, 30 - n - 1) for n in range(30)]
    expected = sum(w * MS + TARGET.forward_s(w) if w else TARGET.forward_s(1) for w in windows)
    assert r.wall_s == pytest.approx(expected)
    assert r.lossless


def test_sd_latency_adds_a_round_trip_per_window():
    lat = 0.5 * MS
    r = simulate([DRAFT, TARGET], [1.0], cfg(method="sd", lookahead=4, max_new_tokens=50, latency_s=lat))
    assert r.wall_s == pytest.approx(10 * (4 * MS + TARGET.forward_s(4) + 2 * lat))


def test_pipespec_alpha_zero_accepts_nothing_and_stays_lossless():
    r = simulate([DRAFT, TARGET], [0.0], cfg(method="pipespec", lookahead=0, max_new_tokens=50))
    assert r.stages[1].tokens_accepted == 0
    assert r.lossless and r.n_tokens == 50


def test_pipespec_alpha_one_runs_at_the_drafters_speed():
    # zero communication cost and a target whose verification costs the same for any number of
    # tokens: the pipeline is as fast as its drafter once the target keeps up (SD would pay the
    # drafts and the verification in turn)
    flat = LatencyProfile("flat-target", ((1, 8 * MS),))
    c = cfg(method="pipespec", lookahead=0, max_new_tokens=600, max_run_ahead=64, max_verify=64)
    r = simulate([DRAFT, flat], [1.0], c)
    assert r.lossless and r.stages[0].rollbacks == 0
    assert r.ms_per_token == pytest.approx(1.0, rel=0.05)
    sd = simulate([DRAFT, flat], [1.0], replace(c, method="sd", decode=replace(c.decode, lookahead=8)))
    assert sd.ms_per_token == pytest.approx((8 * 1 + 8) / 9, rel=0.01)


def test_pipespec_beats_sd_when_drafts_are_good_and_communication_free():
    # (not in general: with alpha ~0.85 and this target, lookahead 0's own steps lose to SD)
    acc = [0.95]
    p = simulate([DRAFT, TARGET], acc, cfg(method="pipespec", lookahead=0, max_new_tokens=300))
    s = simulate([DRAFT, TARGET], acc, cfg(method="sd", lookahead=4, max_new_tokens=300))
    assert p.ms_per_token < 0.85 * s.ms_per_token < 10.0


def test_blocking_header_reads_serialise_the_drafter():
    c = cfg(method="pipespec", lookahead=0, max_new_tokens=200, latency_s=0.1 * MS)
    free = simulate([DRAFT, TARGET], [0.8], c)
    blocked = simulate([DRAFT, TARGET], [0.8], replace(c, blocking_reads=True))
    assert blocked.ms_per_token > free.ms_per_token
    assert blocked.stages[0].read_s > 0 and free.stages[0].read_s == 0
    assert blocked.lossless


# ------------------------------------------------------------------------------ accounting
@pytest.mark.parametrize("method,look", [("pipespec", 0), ("pipespec", 3), ("sd", 3)])
@pytest.mark.parametrize("blocking", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_rollbacks_conserve_tokens(method, look, blocking, seed):
    c = cfg(
        method=method,
        lookahead=look,
        max_new_tokens=120,
        latency_s=0.3 * MS,
        blocking_reads=blocking,
        seed=seed,
    )
    r = simulate([DRAFT, MID, TARGET], [0.6, 0.8], c)
    assert r.lossless and r.n_tokens == 120
    for i, st in enumerate(r.stages):
        # generated by its own actions + adopted from downstream = kept + thrown away
        assert r.token_balance(i) == 0, st
        # a rollback throws away at least one token; what was thrown away cost part of the
        # stage's compute, never more than all of it
        assert (st.rollbacks > 0) == (st.tokens_discarded > 0) and st.rollbacks <= st.tokens_discarded, st
        assert st.discarded_s <= st.busy_s * (1 + 1e-9), st
    last = r.stages[-1]
    assert last.tokens_adopted == 0 and last.tokens_discarded == 0
    assert last.tokens_generated == r.n_tokens
    assert sum(n for n, _ in last.verify_trace) == last.tokens_verified
    assert r.stages[0].rollbacks > 0  # the case exercises rollbacks at all


def test_busy_time_is_the_sum_of_forwards():
    c = cfg(method="pipespec", lookahead=0, max_new_tokens=80, record_timeline=True)
    r = simulate([DRAFT, TARGET], [0.7], c)
    for st in r.stages:
        fw = [e for e in st.timeline if e[2] in ("draft", "verify", "own")]
        assert len(fw) == st.forward_calls
        # timeline times are recorded to the microsecond
        assert sum(e[1] - e[0] for e in fw) == pytest.approx(st.busy_s, abs=1e-6 * len(fw))


# ------------------------------------------------------------------------------ acceptance
def test_oracle_agreement_frequency_matches_the_rate():
    o = TokenOracle([0.3, 0.8], seed=7)
    hs = [mix64(i) for i in range(4000)]
    agree01 = sum(o.token(0, h, 5) == o.token(1, h, 5) for h in hs) / len(hs)
    agree12 = sum(o.token(1, h, 5) == o.token(2, h, 5) for h in hs) / len(hs)
    assert agree01 == pytest.approx(0.3, abs=0.03)
    assert agree12 == pytest.approx(0.8, abs=0.03)
    assert o.token(0, hs[0], 5) == TokenOracle([0.3, 0.8], seed=7).token(0, hs[0], 5)


def test_recorded_traces_decide_on_the_target_path():
    trace = {p: (p % 5 != 4) for p in range(200)}  # a rejection every fifth position
    c = cfg(method="sd", lookahead=8, max_new_tokens=100)
    r = simulate([DRAFT, TARGET], Acceptance((0.0,), (trace,)), c)
    # windows of 8 from a position p = 5k reject at 5k + 4: 4 accepted, 5 tokens per verification
    # (the last window is cut to 4 so that the bonus token still fits in 100)
    assert r.stages[1].verify_trace == [[8, 4]] * 19 + [[4, 4]]


def test_profile_interpolation_and_context():
    p = LatencyProfile("x", ((1, 1.0), (3, 2.0)), per_ctx_s=0.01, ctx_ref=100)
    assert p.forward_s(2, 100) == pytest.approx(1.5)
    assert p.forward_s(5, 100) == pytest.approx(3.0)  # extrapolated with the last slope
    assert p.forward_s(1, 200) == pytest.approx(2.0)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError):
        cfg(method="sd", lookahead=0)
    with pytest.raises(ValueError):
        simulate([DRAFT, TARGET], [0.5, 0.5], cfg())
    with pytest.raises(ValueError):
        simulate([DRAFT, LatencyProfile("lk", kind="lookup")], [0.5], cfg())


def test_lookup_drafter_proposes_many_tokens_per_call():
    lk = LatencyProfile("lookup", ((1, 1e-5),), kind="lookup", max_proposal=8, lookup_hit_rate=0.5)
    r = simulate([lk, TARGET], [0.7], cfg(method="pipespec", lookahead=1, max_new_tokens=100))
    assert r.lossless and r.stages[0].forward_calls == 0 and r.stages[0].draft_steps > 0


# ------------------------------------------------------------------------------ calibration
def _as_run(tmp: Path, results: list[SimResult], prompt_len: int, look: int, clock: bool = True) -> Path:
    """Write simulated prompts as a run directory in the real pipeline's record format. With
    ``clock`` each stage's timeline starts 2 ms after its upstream's and carries the absolute
    start (``t0_perf_counter``), as the pipeline records it; without, the starts are unknown."""
    records = []
    for i, r in enumerate(results):
        stages = []
        for s in r.stages:
            if clock:
                shift = 0.002 * s.stage
                timeline = [[e[0] - shift, e[1] - shift, *e[2:]] for e in s.timeline]
                stages.append(replace(s, timeline=timeline, t0_perf_counter=1000.0 + shift))
            else:
                stages.append(replace(s, t0_perf_counter=0.0))  # no common clock: not recorded
        records.append(Record(
            prompt_id=f"p{i}", replica=0, method=r.method, warmup=False, seq=i + 1,
            prompt_ids=[1] * prompt_len, output_ids=list(r.tokens), text="", n_new_tokens=r.n_tokens,
            finish_reason="length", wall_s=r.wall_s, ms_per_token=r.ms_per_token, ttft_s=0.0,
            window=look, max_run_ahead=DecodeConfig.max_run_ahead, max_verify=DecodeConfig.max_verify,
            max_new_tokens=r.n_tokens, transport="sim", hierarchy="sim",
            models=[s.model for s in r.stages], stages=stages,
        ))  # fmt: skip
    tmp.mkdir(parents=True, exist_ok=True)
    write_records(tmp / "results.jsonl", records)
    return tmp


def _synthetic_run(tmp: Path, blocking: bool = False, clock: bool = True, ar_speed: float = 1.0) -> Path:
    """``ar_speed``: AR's target steps that much faster (it computes alone, on more threads)."""
    draft = replace(DRAFT, overhead_s=0.3 * MS, prefill_per_token_s=0.01 * MS)
    target = replace(TARGET, overhead_s=0.5 * MS, prefill_per_token_s=0.05 * MS)
    alone = replace(target, points=tuple((n, t / ar_speed) for n, t in target.points))
    results = []
    for method, look in (("ar", 0), ("sd", 3), ("pipespec", 2)):
        for seed in range(3):
            dec = DecodeConfig(lookahead=look, max_new_tokens=64, sd_window=None, policy="static")
            c = SimConfig(method=method, decode=dec, prompt_len=40, latency_s=0.4 * MS,
                          blocking_reads=blocking, record_timeline=True, seed=seed)  # fmt: skip
            results.append(simulate([draft, alone if method == "ar" else target], [0.75], c))
    return _as_run(tmp, results, prompt_len=40, look=2, clock=clock)


def _fix_lookahead(run: Path) -> None:
    lines = [json.loads(x) for x in (run / "results.jsonl").read_text().splitlines()]
    for r in lines:
        r["window"] = {"ar": 0, "sd": 3, "pipespec": 2}[r["method"]]
    (run / "results.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")


@pytest.mark.parametrize("blocking, clock", [(False, True), (False, False), (True, True)])
def test_calibration_recovers_a_synthetic_run(tmp_path, blocking, clock):
    # the current pipeline (header reads never wait), with and without the records' common clock,
    # and the old one (header reads of a computing stage waited), calibrated as such
    run = _synthetic_run(tmp_path / "run", blocking=blocking, clock=clock)
    _fix_lookahead(run)
    res = predict_run(run, blocking_reads=blocking)
    assert set(res) == {"ar", "sd", "pipespec"}
    for m, row in res.items():
        assert row["predicted_ms_per_token"] == pytest.approx(row["measured_ms_per_token"], rel=0.05), m
    assert res["pipespec"]["overhead_ms"][0] == pytest.approx(0.3, rel=0.2)
    assert res["sd"]["acceptance"][0] == pytest.approx(0.75, abs=0.1)
    if clock:  # proposals take 0.4 ms to arrive, measured on the common clock
        assert res["sd"]["latency_ms"][0] == pytest.approx(0.4, abs=0.15)


def test_lookup_replays_the_recorded_hits_on_the_target_path():
    lk = LatencyProfile("lookup", ((1, 1e-5),), kind="lookup", max_proposal=8, lookup_hit_rate=1.0)
    c = cfg(method="pipespec", lookahead=1, max_new_tokens=40)
    misses = Acceptance((1.0,), lookup={p: 0 for p in range(40)})
    r = simulate([lk, TARGET], misses, c)  # never hits on the target's path: the target steps alone
    assert r.lossless and r.stages[0].draft_steps == 0 and r.stages[1].own_steps == 40
    short = simulate([lk, TARGET], Acceptance((1.0,), lookup={p: 2 for p in range(40)}), c)
    assert short.lossless and 0 < short.stages[0].tokens_generated <= 2 * short.stages[0].draft_steps


def test_lookup_trace_from_a_record():
    timelines = [
        [[0.0, 0.0, "draft", 4, 14], [0.1, 0.1, "draft", 1, 16]],
        [[0.0, 0.1, "verify", 4, 15], [0.1, 0.2, "own", 1, 16], [0.2, 0.3, "own", 1, 17]],
    ]
    rec = Record(
        prompt_id="p", replica=0, method="pipespec", warmup=False, seq=1, prompt_ids=[1] * 10,
        output_ids=[], text="", n_new_tokens=7, finish_reason="length", wall_s=0.3, ms_per_token=0.0,
        ttft_s=0.0, window=0, max_new_tokens=7, transport="mpi", hierarchy="h", models=["a", "b"],
        stages=[StageStats(stage=s, rank=s, model="m", timeline=t) for s, t in enumerate(timelines)],
    )  # fmt: skip
    assert lookup_trace(rec) == {0: 4, 5: 1, 6: 0}


def test_cli_runs_json_table_and_settings(tmp_path, capsys):
    run = _synthetic_run(tmp_path / "run")
    _fix_lookahead(run)
    assert main([str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in out] == ["ar", "sd", "pipespec"]
    assert {"run", "measured_ms_per_token", "predicted_ms_per_token", "error"} <= set(out[1])
    assert main([str(run), "run.epochs_window=rma"]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0].split()[:2] == ["run", "hierarchy"] and set(text[1]) <= {"-", " "}
    assert main([str(run), "--markdown"]) == 0
    assert capsys.readouterr().out.startswith("| run | hierarchy |")
    assert main([str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err
    # settings are the app's keys, checked as a job checks them; other groups are refused
    for bad in ("decode.max_run_ahead=x", "decode.nope=1", "sampling.top_k=3"):
        assert main([str(run), bad]) == 2
        assert capsys.readouterr().err.startswith("pipespec-simulate: error: invalid configuration")


def test_run_records_feed_the_calibration_table_and_the_planner(tmp_path, capsys):
    from pipespec_mpi.plan.sources import inputs_from_run

    run = _synthetic_run(tmp_path / "run")
    _fix_lookahead(run)
    assert main([str(run), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["ar", "sd", "pipespec"]
    assert all(r["hierarchy"] == "sim" and r["window"] == [2, 3] for r in rows)
    inputs = inputs_from_run(run)  # from the PipeSpec records
    assert (
        inputs.target == "target" and inputs.hierarchy == "sim" and set(inputs.models) == {"draft", "target"}
    )


def test_the_planner_prices_ar_by_the_runs_own_ar_forwards(tmp_path):
    """A run whose AR computed alone on more threads (1.6x faster steps): a plan from its records
    prices AR by AR's forwards, the pipelines by the PipeSpec records' target."""
    from pipespec_mpi.plan.options import Setting
    from pipespec_mpi.plan.sources import RateSource, inputs_from_run

    run = _synthetic_run(tmp_path / "run", ar_speed=1.6)
    _fix_lookahead(run)
    inputs = inputs_from_run(run)
    step = lambda prof: prof.forward_s(1) - prof.overhead_s  # noqa: E731
    assert step(inputs.alone) == pytest.approx(step(inputs.models["target"]) / 1.6, rel=0.05)
    decode = DecodeConfig(max_new_tokens=64)
    ar = RateSource(inputs).ms(("target",), Setting("ar"), decode)
    pipeline_target = RateSource(replace(inputs, alone=None)).ms(("target",), Setting("ar"), decode)
    assert ar == pytest.approx(pipeline_target / 1.6, rel=0.1)
    assert "AR's target from its own" in inputs.source


def test_cli_paper_preset_json():
    # the console script as documented, one seed to keep it quick
    tool = str(Path(sys.executable).with_name("pipespec-simulate"))
    proc = subprocess.run([tool, "--preset", "paper", "--json",
                           "--seeds", "1"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["method"] for r in rows] == ["ar", "sd", "sd", "sd", "pipespec", "pipespec", "pipespec"]
    for r in rows:
        assert set(r) == {"method", "models", "speedup", "ms_per_token"}
        assert r["models"][-1] == "70B"
    assert rows[0]["speedup"] == pytest.approx(1.0)
    assert rows[0]["ms_per_token"] == pytest.approx(123.69)
    best_sd = max(r["speedup"] for r in rows if r["method"] == "sd")
    assert all(r["speedup"] > best_sd for r in rows if r["method"] == "pipespec")


def test_paper_trace_is_rebuilt_from_committed_counts():
    t = committed_to_trace([3, 1, 2], boundary=False)
    assert t == {0: True, 1: True, 2: False, 3: False, 4: True, 5: False}
    assert 2 not in committed_to_trace([3, 1, 2])


# ------------------------------------------------------------------------------ liveness
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("run_ahead", [1, 2, 3, 8])
def test_no_stall_with_tight_run_ahead_and_message_latency(seed, run_ahead):
    """Tight run-ahead bounds, lookaheads and message latencies never stall the simulated pipeline
    (a stage blocked by its bound must still re-send what a downstream epoch change asked for)."""
    look = min(2, run_ahead)
    for accept in ([0.6, 0.5], [0.9, 0.3], [0.3, 0.9]):
        r = simulate(
            [DRAFT, MID, TARGET], accept,
            cfg(method="pipespec", lookahead=look, max_run_ahead=run_ahead, max_new_tokens=48,
                latency_s=0.3 * MS, seed=seed),
        )  # fmt: skip
        assert r.n_tokens == 48 and r.lossless


# ------------------------------------------------------------------------------ batched stages
def test_batched_slots_are_lossless_and_a_flat_forward_scales_throughput():
    """B slots per stage, each its own path: every slot equals its target alone, and where a
    forward costs the same for any number of rows (memory-bound), B sequences decode in about
    the time of one (2.7x here: the slots are not always ready together)."""
    flat = LatencyProfile("target", ((1, 10 * MS), (64, 10 * MS)))
    one = simulate([DRAFT, flat], [0.7], cfg(method="pipespec", lookahead=2, max_new_tokens=60))
    four = simulate(
        [DRAFT, flat], [0.7], cfg(method="pipespec", lookahead=2, max_new_tokens=60, batch_size=4)
    )
    assert len(four.slots) == 4 and all(s.lossless and s.n_tokens == 60 for s in four.slots)
    assert len({tuple(s.tokens) for s in four.slots}) == 4  # four different prompts
    assert four.tokens_per_s > 2.5 * one.tokens_per_s  # slots do not always have work at once


def test_a_compute_bound_forward_and_the_per_sequence_cost_limit_batching():
    """AR at batch 4 over a forward whose cost grows with every row (the CPUs here) gains what
    the profile says: 4 rows cost 10 + 3 * 2 ms, plus 3 ms for each sequence beyond the first."""
    prof = replace(TARGET, per_sequence_s=3 * MS)
    one = simulate([prof], (), cfg(method="ar", max_new_tokens=40))
    four = simulate([prof], (), cfg(method="ar", max_new_tokens=40, batch_size=4))
    assert one.wall_s == pytest.approx(40 * 10 * MS)
    assert four.wall_s == pytest.approx(40 * (10 + 3 * 2 + 3 * 3) * MS)
    assert four.tokens_per_s == pytest.approx(4 * 40 / four.wall_s)


def test_the_adaptive_policy_in_the_paper_setting():
    """Deterministic (simulated time): with no setting chosen per hierarchy, the adaptive policy
    runs the three-stage hierarchy faster than the preset's fixed lookahead 4, and every row
    stays lossless (``simulate`` asserts nothing itself; ``mean_ms_per_token`` over real loops)."""
    from pipespec_mpi.simulate.paper import PaperSetting, paper_rows

    static = {
        tuple(r["models"]): r["speedup"]
        for r in paper_rows(PaperSetting(seeds=(0, 1)))
        if r["method"] == "pipespec"
    }
    adaptive = {
        tuple(r["models"]): r["speedup"]
        for r in paper_rows(PaperSetting(seeds=(0, 1)), policy="adaptive")
        if r["method"] == "pipespec"
    }
    three = ("1B", "8B", "70B")
    assert adaptive[three] > static[three] + 0.1
    assert all(adaptive[m] > 0.9 * static[m] for m in static)


def test_an_adaptive_simulation_is_lossless_batched_too():
    decode = DecodeConfig(policy="adaptive", max_new_tokens=60, max_run_ahead=8, max_verify=8, sd_window=None)
    for b in (1, 3):
        r = simulate([DRAFT, MID, TARGET], (0.7, 0.8), SimConfig(decode=decode, batch_size=b, seed=b))
        for s in r.slots or [r]:
            assert s.lossless and s.n_tokens == 60
