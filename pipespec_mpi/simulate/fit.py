"""Simulator inputs fitted from a run directory (``RunFit``, ``fit_run``) and the run re-simulated
with them: ``predict_run`` puts the simulator's ms/token beside the measured one, per method or
per record (``pipespec-simulate RUN_DIR``)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pipespec_mpi.analysis.analytical import alpha_from_trace
from pipespec_mpi.config import METHODS, ConfigError, DecodeConfig, load_run_config
from pipespec_mpi.records import Record
from pipespec_mpi.simulate.engine import SimResult, simulate
from pipespec_mpi.simulate.inputs import Acceptance, LatencyProfile, SimConfig
from pipespec_mpi.simulate.traces import (
    _lookup_chain_rate,
    _offsets,
    _quantile,
    agreement_trace,
    fit_profile,
    latency_samples,
    load_records,
    lookup_trace,
    overhead_samples,
)


@dataclass(frozen=True)
class RunFit:
    """Simulator inputs fitted from records of one method."""

    method: str
    profiles: tuple[LatencyProfile, ...]
    rates: tuple[float, ...]
    down_latency_s: tuple[float, ...]  # medians
    up_latency_s: tuple[float, ...]


def _pooled_rate(recs: Sequence[Record], stage: int) -> float:
    trace = [t for r in recs for t in r.stages[stage].verify_trace]
    return alpha_from_trace(trace)


def fit_run(recs: Sequence[Record], blocking_reads: bool = False) -> RunFit:
    """Fit profiles, per-pair acceptance and latencies from records of one method
    (``blocking_reads``: the records come from a pipeline whose header reads blocked)."""
    if not recs:
        raise ValueError("no records to fit")
    method = recs[0].method
    k = len(recs[0].stages)
    names = list(recs[0].models or [f"stage{i}" for i in range(k)])
    profiles = []
    for i in range(k):
        srs = [r.stages[i] for r in recs]
        if method == "ar" and i < k - 1:
            profiles.append(LatencyProfile(name=names[i]))  # idle in AR
            continue
        kind = "model"
        if i == 0 and all((s.forward_calls == 0 and s.draft_steps > 0) for s in srs):
            kind = "lookup"
        try:
            prof = fit_profile(srs, names[i], kind)
        except ValueError:  # the stage never ran a forward (e.g. a lookup that never hit)
            profiles.append(
                LatencyProfile(name=names[i], points=((1.0, 1e-6),), kind=kind, lookup_hit_rate=0.0)
            )
            continue
        if kind == "lookup":
            # misses leave no event; each makes the verifier take a step of its own (its upstream
            # is idle), so hits / (hits + those steps) estimates how often a context recurs
            hits = sum(s.draft_steps for s in srs)
            own = sum(r.stages[1].own_steps for r in recs)
            longest = max(int(n) for n, _ in prof.points)
            prof = replace(prof, lookup_hit_rate=hits / (hits + own) if hits + own else 1.0,
                           max_proposal=longest, lookup_chain_rate=_lookup_chain_rate(recs))  # fmt: skip
        samples = [overhead_samples(r, i, blocking_reads) for r in recs]
        to_act = [x for a, _ in samples for x in a]
        to_wait = [x for _, w in samples for x in w]
        # a stage that often acts back to back (a drafter) pays the loop's cost between actions;
        # one that waits after each action (a verifier) publishes its new demand only after it
        ov = to_act if len(to_act) >= 10 or not to_wait else to_wait
        if ov:
            prof = replace(prof, overhead_s=statistics.fmean(ov), overhead_draws=tuple(to_act + to_wait))
        profiles.append(prof)
    rates, downs, ups = [], [], []
    for j in range(k - 1):
        rates.append(_pooled_rate(recs, j + 1) if method != "ar" else 0.0)
        d_s: list[float] = []
        u_s: list[float] = []
        for r in recs if method != "ar" else []:
            d, u = latency_samples(r, j)
            if d and _offsets(r) is None:
                # no common clock (older records): each rank's timeline starts at its own exit
                # from the start barrier. Take the fastest deliveries as equal in both directions
                # (NTP-like), or as immediate where only proposals are seen, and measure again
                # with that offset (which proposals count as awaited depends on it)
                skew = (_quantile(u, 0.05) - _quantile(d, 0.05)) / 2 if u else -_quantile(d, 0.05)
                d, u = latency_samples(r, j, skew)
            d_s += d
            u_s += u
        down = max(0.0, statistics.median(d_s)) if d_s else None
        up = max(0.0, statistics.median(u_s)) if u_s else None
        downs.append(down if down is not None else (up if up is not None else 0.0))
        ups.append(up if up is not None else downs[-1])
    return RunFit(method, tuple(profiles), tuple(rates), tuple(downs), tuple(ups))


def recorded_prefills(rec: Record) -> tuple[float, ...]:
    """Each stage's prefill time in a record (0 where a stage did not prefill)."""
    out = []
    for sr in rec.stages:
        pre = [e[1] - e[0] for e in sr.timeline if e[2] == "prefill"]
        out.append(pre[0] if pre else 0.0)
    return tuple(out)


def simulate_record(
    rec: Record,
    fit: RunFit,
    use_traces: bool = True,
    max_run_ahead: int = DecodeConfig.max_run_ahead,
    max_verify: int = DecodeConfig.max_verify,
    seed: int = 0,
    blocking_reads: bool = False,
) -> SimResult:
    """Re-run one recorded prompt in the simulator with the fit's inputs, each stage
    starting (on the records' common clock) and prefilling as it did in the run."""
    k = len(fit.profiles)
    traces = tuple(agreement_trace(rec, j + 1) for j in range(k - 1)) if use_traces else ()
    lookup = lookup_trace(rec) if use_traces and k > 1 and fit.profiles[0].kind == "lookup" else None
    look = (rec.window or 0) if rec.method != "ar" else 0
    if rec.method == "sd":
        look = max(1, look)  # the record's lookahead is SD's window
    decode = DecodeConfig(
        lookahead=look,
        sd_window=None,  # the window is ``look`` for every method
        max_new_tokens=max(1, rec.n_new_tokens),
        max_run_ahead=rec.max_run_ahead or max_run_ahead,
        max_verify=rec.max_verify or max_verify,
        policy=rec.policy,
        draft_survival=rec.draft_survival if rec.draft_survival is not None else DecodeConfig.draft_survival,
    )
    cfg = SimConfig(
        method=rec.method,
        decode=decode,
        prompt_len=len(rec.prompt_ids),
        prefill_s=recorded_prefills(rec),
        start_s=tuple(_offsets(rec) or (0.0,) * k),
        latency_s=fit.down_latency_s,
        up_latency_s=fit.up_latency_s,
        blocking_reads=blocking_reads,
        seed=seed,
    )
    return simulate(fit.profiles, Acceptance(fit.rates, traces, lookup), cfg)


def run_decode_config(run_dir: str | Path) -> dict:
    """The run's bounds (decode.max_run_ahead, decode.max_verify) from its config, if it has one
    that still loads (else the caller's defaults)."""
    try:
        d = load_run_config(run_dir).decode
    except (OSError, ConfigError):
        return {}
    return {"max_run_ahead": d.max_run_ahead, "max_verify": d.max_verify}


def predict_run(
    run_dir: str | Path,
    scope: str = "method",
    use_traces: bool = True,
    max_run_ahead: int = DecodeConfig.max_run_ahead,
    max_verify: int = DecodeConfig.max_verify,
    blocking_reads: bool = False,
    seeds: Sequence[int] = (0, 1, 2, 3),
) -> dict[str, dict]:
    """Measured vs predicted ms/token per method found in a run directory.

    scope="method" fits one fit per method from all its records; scope="record" fits one
    per record (follows load that changes during the run on a shared machine). Every record is
    simulated once per seed (the seed draws agreement away from the recorded path and the loop's
    overheads; one seed alone moves a prediction by several percent) and the times averaged.
    blocking_reads: the run was made with the old MPI RMA epochs window, whose header reads waited
    for a computing neighbour (before ``SharedEpochWindow``); current runs read headers at once.
    """
    recs = load_records(run_dir)
    decode = run_decode_config(run_dir)
    max_run_ahead = int(decode.get("max_run_ahead", max_run_ahead))
    max_verify = int(decode.get("max_verify", max_verify))
    by_method: dict[str, list[Record]] = {}
    for r in recs:
        by_method.setdefault(r.method, []).append(r)
    out: dict[str, dict] = {}
    for method in [m for m in METHODS if m in by_method] + sorted(set(by_method) - set(METHODS)):
        rs = by_method[method]
        fit = fit_run(rs, blocking_reads) if scope == "method" else None
        wall = sim_wall = 0.0
        tokens = 0
        for r in rs:
            c = fit if fit is not None else fit_run([r], blocking_reads)
            for seed in seeds:
                sim = simulate_record(r, c, use_traces, max_run_ahead, max_verify, seed, blocking_reads)
                sim_wall += sim.wall_s / len(seeds)
            wall += r.wall_s
            tokens += r.n_new_tokens
        measured = 1000.0 * wall / tokens if tokens else float("nan")
        predicted = 1000.0 * sim_wall / tokens if tokens else float("nan")
        row = {
            "measured_ms_per_token": measured,
            "predicted_ms_per_token": predicted,
            "error": predicted / measured - 1.0 if measured else float("nan"),
            "n_prompts": len(rs),
            "n_tokens": tokens,
        }
        if fit is not None:
            row["acceptance"] = list(fit.rates)
            row["latency_ms"] = [1000 * x for x in fit.down_latency_s]
            row["up_latency_ms"] = [1000 * x for x in fit.up_latency_s]
            row["overhead_ms"] = [1000 * p.overhead_s for p in fit.profiles]
        out[method] = row
    return out
