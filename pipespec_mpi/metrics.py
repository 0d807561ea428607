"""Metric definitions (pure functions over records; see README "Output contract").

Definitions follow what users know from vLLM / llama.cpp:
  mean acceptance length   1 + accepted proposal tokens / verifications
  per-position acceptance  for proposal position j: fraction of verifications that accepted it,
                           among verifications that proposed at least j+1 tokens
  accepted histogram       how many verifications accepted 0, 1, 2, ... tokens (paper Fig. 3)
  ms per token             total decode time over total generated tokens (as in the paper)
  busy fraction            a stage's compute time (prefill, drafts, verifications, own steps)
                           over the prompt's wall time
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from pipespec_mpi.records import (
    BenchmarkRow,
    MethodSummary,
    PairAcceptance,
    Record,
    SpeedupPerPrompt,
    StageSummary,
)

PERCENTILES = (50, 90, 99)  # of per-token latency in summary.json


def acceptance(trace: Sequence[Sequence[int]]) -> PairAcceptance:
    """Acceptance statistics of one verifier from its [n_proposed, n_accepted] trace."""
    verifs = len(trace)
    accepted = sum(a for _, a in trace)
    proposed = sum(n for n, _ in trace)
    longest = max((n for n, _ in trace), default=0)
    per_pos = []
    for j in range(longest):
        eligible = [a for n, a in trace if n > j]
        per_pos.append(sum(1 for a in eligible if a > j) / len(eligible) if eligible else 0.0)
    hist = [0] * (longest + 1)
    for _, a in trace:
        hist[a] += 1
    return PairAcceptance(
        verifications=verifs,
        proposed=proposed,
        accepted=accepted,
        mean_accepted=accepted / verifs if verifs else 0.0,
        mean_acceptance_length=1 + accepted / verifs if verifs else 0.0,
        acceptance_rate=accepted / proposed if proposed else 0.0,
        per_position_acceptance=per_pos,
        accepted_histogram=hist,
    )


def percentiles(xs: Sequence[float], qs: Sequence[int]) -> dict[str, float]:
    """``p<q>`` of ``xs`` for each q in percent: linear interpolation between the closest ranks
    (``statistics.quantiles``' inclusive method, numpy's default); the value itself for one."""
    if len(xs) < 2:
        return {f"p{q}": xs[0] for q in qs}
    cuts = statistics.quantiles(xs, n=100, method="inclusive")
    return {f"p{q}": cuts[q - 1] for q in qs}


def latency_percentiles_ms(latencies_s: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99 of per-token latencies, in ms (``percentiles``); 0 without latencies."""
    if not latencies_s:
        return {f"p{q}": 0.0 for q in PERCENTILES}
    return {k: 1000 * v for k, v in percentiles(latencies_s, PERCENTILES).items()}


def token_latencies(commit_times: Sequence[Sequence[float]]) -> list[float]:
    """Per-token latency (s): each commit's interval spread over the tokens it committed."""
    out: list[float] = []
    prev_t, prev_n = 0.0, 0
    for t, n in commit_times:
        k = int(n) - prev_n
        if k > 0:
            out.extend([(t - prev_t) / k] * k)
        prev_t, prev_n = t, int(n)
    return out


def group_key(method: str, batch_size: int) -> str:
    """The key of a method's results at a batch size in summary.json and benchmark.json:
    ``pipespec`` at batch 1 (as before batching), ``pipespec@b4`` at 4."""
    return method if batch_size == 1 else f"{method}@b{batch_size}"


def decoding_wall_s(rs: Sequence[Record]) -> float:
    """The time ``rs`` took to decode. At batch 1 a replica decodes one sequence at a time: the
    records' walls summed. Batched, a replica's sequences overlap: from its first start to its
    last end on the leader's clock (``t0_perf_counter``), summed over the replicas (which run at
    once: tokens / this is the tokens/s of one replica, as at batch 1)."""
    if all(r.batch_size == 1 for r in rs):
        return sum(r.wall_s for r in rs)
    span = 0.0
    for rep in {r.replica for r in rs}:
        mine = [r for r in rs if r.replica == rep]
        start = min(r.stages[-1].t0_perf_counter for r in mine)
        span += max(r.stages[-1].t0_perf_counter + r.wall_s for r in mine) - start
    return span


def summarize(records: Iterable[Record]) -> dict[str, MethodSummary]:
    """summary.json: per method and batch size (``group_key``), over the non-warm-up records."""
    by_method: dict[str, list[Record]] = {}
    for r in records:
        if not r.warmup:
            by_method.setdefault(group_key(r.method, r.batch_size), []).append(r)
    out = {}
    for method, rs in by_method.items():
        tokens = sum(r.n_new_tokens for r in rs)
        wall = decoding_wall_s(rs)
        n_stages = len(rs[0].stages)
        pairs = {}
        for s in range(1, n_stages):
            trace = [t for r in rs for t in r.stages[s].verify_trace]
            pairs[f"{s - 1}->{s}"] = acceptance(trace)
        stages = []
        for s in range(n_stages):
            st = [r.stages[s] for r in rs]
            fwd = sum(x.forward_calls for x in st)
            verifs = sum(x.verifications for x in st)
            stages.append(StageSummary(
                model=st[0].model,
                forward_calls=fwd,
                rollbacks=sum(x.rollbacks for x in st),
                tokens_discarded=sum(x.tokens_discarded for x in st),
                discarded_s=sum(x.discarded_s for x in st),
                busy_fraction=sum(x.busy_s + x.prefill_s for x in st) / wall if wall else 0.0,
                verifications=verifs,
                own_steps=sum(x.own_steps for x in st),
                proposals_per_forward=verifs / fwd if fwd else 0.0,
                tokens_per_forward=sum(x.tokens_generated for x in st) / fwd if fwd else 0.0,
                drafter=drafter_summary([x.drafter for x in st]),
            ))  # fmt: skip
        lat = [x for r in rs for x in token_latencies(r.stages[-1].commit_times)]
        out[method] = MethodSummary(
            n_prompts=len(rs),
            n_tokens=tokens,
            wall_s=wall,
            ms_per_token=1000 * wall / tokens if tokens else 0.0,
            tokens_per_s=tokens / wall if wall else 0.0,
            ttft_s_mean=statistics.fmean(r.ttft_s for r in rs),
            token_latency_ms=latency_percentiles_ms(lat),
            acceptance=pairs,
            mean_accepted_per_verification={k: v.mean_accepted for k, v in pairs.items()},
            stages=stages,
            peak_rss_mb=[max(r.stages[s].peak_rss_mb for r in rs) for s in range(n_stages)],
            batch_size=rs[0].batch_size,
            sequence_ms_per_token=_sequence_ms([r.ms_per_token for r in rs if r.n_new_tokens]),
            **_energy(rs, tokens),
            **_cost(rs, tokens, wall),
        )
    return out


def _cost(rs: Sequence[Record], tokens: int, wall: float) -> dict:
    """Core-hours (GPU-hours on GPUs) per million output tokens: the threads (GPUs) of one
    replica's ranks times the method's decoding wall time (summed over replicas), over its tokens.
    Absent from records that predate the counts."""
    if not tokens:
        return {}
    cores = max(sum(s.threads for s in r.stages) for r in rs)
    gpus = max(sum(s.n_gpus for s in r.stages) for r in rs)
    out = {}
    if cores:
        out["core_hours_per_million_tokens"] = cores * wall / 3600 / tokens * 1e6
    if gpus:
        out["gpu_hours_per_million_tokens"] = gpus * wall / 3600 / tokens * 1e6
    return out


def drafter_summary(counts: Sequence[dict]) -> dict[str, dict[str, float]]:
    """A model-free drafter's counters (``DrafterCounts``, one per record) summed per source, with
    the mean accepted tokens per proposal; {} for a drafter that keeps none."""
    out: dict[str, dict[str, float]] = {}
    for c in counts:
        for what in ("proposals", "proposed", "accepted"):
            for source, n in (c.get(what) or {}).items():
                row = out.setdefault(source, {"proposals": 0, "proposed": 0, "accepted": 0})
                row[what] += n
    for row in out.values():
        row["mean_accepted"] = row["accepted"] / row["proposals"] if row["proposals"] else 0.0
    return dict(sorted(out.items()))


def _sequence_ms(xs: list[float]) -> dict[str, float]:
    """Each sequence's own ms/token: p50, p90, mean (empty without sequences)."""
    return {**percentiles(xs, (50, 90)), "mean": statistics.fmean(xs)} if xs else {}


def _energy(rs: list[Record], tokens: int) -> dict:
    """Energy per token from NVML samples (GPU runs only): per GPU (mean over the GPUs, as the
    paper's figure) and summed over the system."""
    per_gpu: dict[tuple[int, int], float] = {}
    for r in rs:
        for st in r.stages:
            for g in st.gpus:
                key = (st.rank, g["device"])
                per_gpu[key] = per_gpu.get(key, 0.0) + g["energy_j"]
    if not per_gpu or not tokens:
        return {}
    total = sum(per_gpu.values())
    return {
        "energy_j_per_token_system": total / tokens,
        "energy_j_per_token_per_gpu": total / tokens / len(per_gpu),
        "n_gpus_measured": len(per_gpu),
    }


def benchmark_table(records: Iterable[Record], methods: Sequence[str]) -> dict[str, BenchmarkRow]:
    """benchmark.json: per method (and batch size, ``group_key``) ms/token, tokens/s and speedup
    over ``ar`` at the same batch size (aggregate ratio, and median/min/max of per-prompt ratios
    of ms/token over the prompts every method decoded)."""
    rs = [r for r in records if not r.warmup]
    summary = summarize(rs)
    per_prompt: dict[str, dict[str, float]] = {}
    for r in rs:
        key = f"{r.replica}:{r.prompt_id}:{r.batch_size}"
        per_prompt.setdefault(key, {})[r.method] = r.ms_per_token
    out = {}
    sizes = sorted({r.batch_size for r in rs})
    for b, m in [(b, m) for b in sizes for m in methods]:
        key, ar = group_key(m, b), group_key("ar", b)
        if key not in summary:
            continue
        s = summary[key]
        row = BenchmarkRow(
            n_prompts=s.n_prompts,
            n_tokens=s.n_tokens,
            wall_s=s.wall_s,
            ms_per_token=s.ms_per_token,
            tokens_per_s=s.tokens_per_s,
            mean_accepted_per_verification=s.mean_accepted_per_verification,
            busy_fraction=[st.busy_fraction for st in s.stages],
            batch_size=b,
            sequence_ms_per_token=s.sequence_ms_per_token,
        )
        if ar in summary:
            row.speedup = summary[ar].ms_per_token / s.ms_per_token
            ratios = [
                p["ar"] / p[m]
                for k, p in per_prompt.items()
                if k.endswith(f":{b}") and "ar" in p and m in p and p[m] > 0
            ]
            if ratios:
                row.speedup_per_prompt = SpeedupPerPrompt(
                    median=statistics.median(ratios), min=min(ratios), max=max(ratios), n=len(ratios)
                )
        out[key] = row
    return out
