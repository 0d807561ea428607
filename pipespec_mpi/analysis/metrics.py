"""Metric definitions (pure functions over records; see docs/outputs.md).

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
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from pipespec_mpi.records import (
    BenchmarkRow,
    MethodSummary,
    PairAcceptance,
    Record,
    SpeedupPerPrompt,
    StageSummary,
    group_key,
)
from pipespec_mpi.stage.stats import StageStats

PERCENTILES = (50, 90, 99)  # of per-token latency in summary.json


def acceptance(trace: Sequence[Sequence[int]]) -> PairAcceptance:
    """Acceptance statistics of one verifier from its [n_proposed, n_accepted] trace."""
    return acceptance_of_counts(Counter((n, a) for n, a in trace))


def acceptance_of_counts(counts: Mapping[tuple[int, int], int]) -> PairAcceptance:
    """``acceptance`` of a trace given as how many times each (n_proposed, n_accepted) pair
    occurs in it: the same numbers, from at most window x window counts however long the trace."""
    pairs = [(n, a, c) for (n, a), c in counts.items() if c > 0]
    verifs = sum(c for _, _, c in pairs)
    accepted = sum(a * c for _, a, c in pairs)
    proposed = sum(n * c for n, _, c in pairs)
    longest = max((n for n, _, _ in pairs), default=0)
    per_pos = []
    for j in range(longest):
        eligible = sum(c for n, _, c in pairs if n > j)
        hits = sum(c for n, a, c in pairs if n > j and a > j)
        per_pos.append(hits / eligible if eligible else 0.0)
    hist = [0] * (longest + 1)
    for _, a, c in pairs:
        hist[a] += c
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


def decoding_wall_s(rs: Iterable[Record]) -> float:
    """The time ``rs`` took to decode. At batch 1 a replica decodes one sequence at a time: the
    records' walls summed. Batched, a replica's sequences overlap: from its first start to its
    last end on the leader's clock (``t0_perf_counter``), summed over the replicas (which run at
    once: tokens / this is the tokens/s of one replica, as at batch 1)."""
    wall = _DecodingWall()
    for r in rs:
        wall.add(r)
    return wall.total()


class _DecodingWall:
    """``decoding_wall_s`` fed one record at a time: the walls (for batch 1) and each phase's
    first start and last end in each replica (batched; a group of records whose phases ran
    apart, as ``run.batch_sizes=[4,16,4,16]`` runs them, spans each phase, not the time between)."""

    def __init__(self) -> None:
        self.batched = False  # a record at batch > 1: the spans, else the walls summed
        self.walls = array("d")  # summed by sum() at the end (why: ``_Group``)
        self.spans: dict[tuple[int, int | None], list[float]] = {}  # (replica, phase) -> [start, end]

    def add(self, r: Record) -> None:
        self.batched = self.batched or r.batch_size != 1
        self.walls.append(r.wall_s)
        start = r.stages[-1].t0_perf_counter
        end = start + r.wall_s
        span = self.spans.setdefault((r.replica, r.phase), [start, end])
        span[0], span[1] = min(span[0], start), max(span[1], end)

    def total(self) -> float:
        if not self.batched:
            return sum(self.walls)
        span = 0.0
        # the phases in the order of a set of them, as the spans were always added up: the
        # same float (a set built by the same insertions iterates in the same order)
        for key in {key for key in self.spans}:
            start, end = self.spans[key]
            span += end - start
        return span


class _CpuSpans:
    """The cores one stage's rank kept busy while it worked on a group's records: its process CPU
    time over its own clock's time, from a job's start on it to its stats' handoff (``StageStats``
    ``cpu_start_s``, ``cpu_end_s``, ``t0_perf_counter``, ``t1_perf_counter``), per record at batch
    1 (other methods' records run between them) and over each batched phase (its slots' jobs
    overlap, and a rank that has no part in a method still waits at the phase's deals)."""

    def __init__(self) -> None:
        self.spans: dict[tuple, list[float]] = {}  # key -> [cpu first, cpu last, t first, t last]

    def add(self, key: tuple, st: StageStats) -> None:
        if st.t1_perf_counter <= 0.0:  # a record from before these fields
            return
        span = self.spans.setdefault(
            key, [st.cpu_start_s, st.cpu_end_s, st.t0_perf_counter, st.t1_perf_counter]
        )
        span[0], span[1] = min(span[0], st.cpu_start_s), max(span[1], st.cpu_end_s)
        span[2], span[3] = min(span[2], st.t0_perf_counter), max(span[3], st.t1_perf_counter)

    def cores(self, wall: float) -> float | None:
        """CPU seconds per second, or None where the rank spent under 1% of the group's ``wall``
        on its records (a stage with no part in a method at batch 1 hands its stats over at once)."""
        cpu = sum(s[1] - s[0] for s in self.spans.values())
        busy = sum(s[3] - s[2] for s in self.spans.values())
        if busy <= 0.0 or busy < 0.01 * wall:
            return None
        return cpu / busy


class _StageTotals:
    """One stage's part of a ``_Group``."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.forward_calls = self.rollbacks = self.tokens_discarded = 0
        self.verifications = self.own_steps = self.tokens_generated = 0
        self.waits_chosen = self.waits_joined = self.verify_cut = self.drafts_held = 0
        self.discarded_s = array("d")  # per record, summed by sum() at the end (``_Group``)
        self.compute_s = array("d")  # busy + prefill, per record, likewise
        self.peak_rss_mb: float | None = None
        self.drafter: dict[str, dict[str, float]] = {}  # ``_add_drafter``
        self.cpu = _CpuSpans()

    def add(self, st: StageStats, span: tuple) -> None:
        """``st`` of a record; ``span``: the key its CPU time is measured over (``_CpuSpans``)."""
        self.cpu.add(span, st)
        self.forward_calls += st.forward_calls
        self.rollbacks += st.rollbacks
        self.tokens_discarded += st.tokens_discarded
        self.verifications += st.verifications
        self.own_steps += st.own_steps
        self.waits_chosen += st.waits_chosen
        self.waits_joined += st.waits_joined
        self.verify_cut += st.verify_cut
        self.drafts_held += st.drafts_held
        self.tokens_generated += st.tokens_generated
        self.discarded_s.append(st.discarded_s)
        self.compute_s.append(st.busy_s + st.prefill_s)
        rss = st.peak_rss_mb
        self.peak_rss_mb = rss if self.peak_rss_mb is None else max(self.peak_rss_mb, rss)
        _add_drafter(self.drafter, st.drafter)

    def summary(self, wall: float) -> StageSummary:
        fwd, verifs = self.forward_calls, self.verifications
        return StageSummary(
            model=self.model,
            forward_calls=fwd,
            rollbacks=self.rollbacks,
            tokens_discarded=self.tokens_discarded,
            discarded_s=sum(self.discarded_s),
            busy_fraction=sum(self.compute_s) / wall if wall else 0.0,
            verifications=verifs,
            own_steps=self.own_steps,
            proposals_per_forward=verifs / fwd if fwd else 0.0,
            tokens_per_forward=self.tokens_generated / fwd if fwd else 0.0,
            waits_chosen=self.waits_chosen,
            waits_joined=self.waits_joined,
            verify_cut=self.verify_cut,
            drafts_held=self.drafts_held,
            drafter=_drafter_rows(self.drafter),
            cpu_cores=self.cpu.cores(wall),
        )


class _Group:
    """One entry of summary.json (a method at a batch size), accumulated one record at a time.

    Why: ``summarize`` and ``benchmark_table`` take any iterable of records (a generator reading
    results.jsonl) in one pass and keep none of the records, so memory does not grow with their
    per-token traces (a 100,000-record job's finalize held every record before: hundreds of MB).
    Kept: counts and integer sums; each verifier's trace as counts of its (n_proposed,
    n_accepted) pairs (at most window x window of them); the first record's stage models and
    batch size; and in 8-byte arrays what exact results need: every token's latency and every
    sequence's ms/token (percentiles), and the floats that were added up with sum() and
    statistics.fmean() over the group's records (walls, each stage's compute and discarded
    times, TTFTs). Those are summed by the same functions in the same (record) order at the end,
    so the results are the same floats on every Python: since 3.12, sum() compensates rounding,
    and a running += would differ from it in the last bits.
    """

    def __init__(self, first: Record) -> None:
        self.batch_size = first.batch_size
        self.method = first.method
        self.n_prompts = 0
        self.n_tokens = 0
        self.wall = _DecodingWall()
        self.ttft_s = array("d")
        self.sequence_ms = array("d")  # of the records that generated tokens
        self.token_latencies = array("d")
        self.stages = [_StageTotals(st.model) for st in first.stages]
        self.pairs: dict[tuple[int, int], Counter[tuple[int, int]]] = {}  # (proposer, verifier) -> trace
        self.energy_j: dict[tuple[int, int], float] = {}  # per (rank, device)
        self.cores = 0.0  # the most of one record's ranks together (``_cost``)
        self.n_gpus = 0

    def add(self, r: Record) -> None:
        self.n_prompts += 1
        self.n_tokens += r.n_new_tokens
        self.wall.add(r)
        self.ttft_s.append(r.ttft_s)
        if r.n_new_tokens:
            self.sequence_ms.append(r.ms_per_token)
        self.token_latencies.extend(token_latencies(r.stages[-1].commit_times))
        span = (r.replica, r.phase) if r.batch_size != 1 else (r.replica, self.n_prompts)
        for s, totals in enumerate(self.stages):
            totals.add(r.stages[s], span)
        for up, s in r.pairs():
            self.pairs.setdefault((up, s), Counter()).update((n, a) for n, a in r.stages[s].verify_trace)
        for st in r.stages:
            for g in st.gpus:
                key = (st.rank, g["device"])
                self.energy_j[key] = self.energy_j.get(key, 0.0) + g["energy_j"]
        self.cores = max(self.cores, sum(st.threads if st.cores is None else st.cores for st in r.stages))
        self.n_gpus = max(self.n_gpus, sum(st.n_gpus for st in r.stages))

    def summary(self) -> MethodSummary:
        tokens, wall = self.n_tokens, self.wall.total()
        pairs = {f"{up}->{s}": acceptance_of_counts(trace) for (up, s), trace in sorted(self.pairs.items())}
        return MethodSummary(
            n_prompts=self.n_prompts,
            n_tokens=tokens,
            wall_s=wall,
            ms_per_token=1000 * wall / tokens if tokens else 0.0,
            tokens_per_s=tokens / wall if wall else 0.0,
            ttft_s_mean=statistics.fmean(self.ttft_s),
            token_latency_ms=latency_percentiles_ms(self.token_latencies),
            acceptance=pairs,
            mean_accepted_per_verification={k: v.mean_accepted for k, v in pairs.items()},
            stages=[st.summary(wall) for st in self.stages],
            peak_rss_mb=[st.peak_rss_mb for st in self.stages],
            batch_size=self.batch_size,
            method=self.method,
            sequence_ms_per_token=_sequence_ms(self.sequence_ms),
            **_energy(self.energy_j, tokens),
            **_cost(self.cores, self.n_gpus, tokens, wall),
        )


def _add(groups: dict[str, _Group], r: Record) -> None:
    """``r`` into its group (``group_key``); a group starts at its first record."""
    key = group_key(r.method, r.batch_size)
    if key not in groups:
        groups[key] = _Group(r)
    groups[key].add(r)


class Totals:
    """A run's aggregates in one pass over its records, keeping none of them (``_Group``):
    summary.json's entries, and with ``per_prompt`` benchmark.json's (each record's ms/token is
    kept for the per-prompt speedups). ``add`` every record (warm-ups are skipped here), then
    ``summary()`` / ``benchmark()``. Finalize feeds one while it writes the output file, so that
    results.jsonl is read once for all three."""

    def __init__(self, per_prompt: bool = False) -> None:
        self.groups: dict[str, _Group] = {}
        # batch size -> (replica, prompt_id) -> method -> ms/token (of the last such record)
        self.per_prompt: dict[int, dict[tuple[int, str], dict[str, float]]] | None = (
            {} if per_prompt else None
        )

    def add(self, r: Record) -> None:
        if r.warmup:
            return
        _add(self.groups, r)
        if self.per_prompt is not None:
            prompt = (r.replica, r.prompt_id)
            self.per_prompt.setdefault(r.batch_size, {}).setdefault(prompt, {})[r.method] = r.ms_per_token

    def summary(self) -> dict[str, MethodSummary]:
        return {key: g.summary() for key, g in self.groups.items()}

    def benchmark(self, methods: Sequence[str]) -> dict[str, BenchmarkRow]:
        if self.per_prompt is None:
            raise ValueError("Totals(per_prompt=True) keeps what benchmark() needs")
        return _benchmark_rows(self.summary(), self.per_prompt, methods)


def summarize(records: Iterable[Record]) -> dict[str, MethodSummary]:
    """summary.json: per method and batch size (``group_key``), over the non-warm-up records, in
    one pass over ``records`` that keeps none of them."""
    totals = Totals()
    for r in records:
        totals.add(r)
    return totals.summary()


def _cost(cores: float, gpus: int, tokens: int, wall: float) -> dict:
    """Core-hours (GPU-hours on GPUs) per million output tokens: the CPUs (GPUs) one replica's
    ranks hold (the most of any record: their ``cores``, each model stage its share of the node
    and a model-free stage beside them none; records from before the field count threads) times
    the method's decoding wall time (summed over replicas), over its tokens. Absent from records
    that predate the counts."""
    if not tokens:
        return {}
    out = {}
    if cores:
        out["core_hours_per_million_tokens"] = cores * wall / 3600 / tokens * 1e6
    if gpus:
        out["gpu_hours_per_million_tokens"] = gpus * wall / 3600 / tokens * 1e6
    return out


def _add_drafter(out: dict[str, dict[str, float]], c: dict) -> None:
    """One record's drafter counters into the running sums ``out`` (source -> counter -> n)."""
    for what in ("proposals", "proposed", "accepted"):
        for source, n in (c.get(what) or {}).items():
            row = out.setdefault(source, {"proposals": 0, "proposed": 0, "accepted": 0})
            row[what] += n


def _drafter_rows(sums: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """A model-free drafter's counters summed per source (``_add_drafter``, one record at a time),
    with the mean accepted tokens per proposal, sorted by source; {} for a drafter that keeps none."""
    return {
        source: {**row, "mean_accepted": row["accepted"] / row["proposals"] if row["proposals"] else 0.0}
        for source, row in sorted(sums.items())
    }


def _sequence_ms(xs: Sequence[float]) -> dict[str, float]:
    """Each sequence's own ms/token: p50, p90, mean (empty without sequences)."""
    return {**percentiles(xs, (50, 90)), "mean": statistics.fmean(xs)} if xs else {}


def _energy(per_gpu: Mapping[tuple[int, int], float], tokens: int) -> dict:
    """Energy per token from NVML samples (GPU runs only), from the joules per (rank, device): per
    GPU (mean over the GPUs, as the paper's figure) and summed over the system."""
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
    of ms/token over the prompts every method decoded). One pass over ``records``, keeping none
    of them but each one's ms/token (``Totals``)."""
    totals = Totals(per_prompt=True)
    for r in records:
        totals.add(r)
    return totals.benchmark(methods)


def _benchmark_rows(
    summary: Mapping[str, MethodSummary],
    per_prompt: Mapping[int, Mapping[tuple[int, str], Mapping[str, float]]],
    methods: Sequence[str],
) -> dict[str, BenchmarkRow]:
    out = {}
    for b, m in [(b, m) for b in sorted(per_prompt) for m in methods]:
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
            method=m,
            sequence_ms_per_token=s.sequence_ms_per_token,
        )
        if ar in summary and s.ms_per_token > 0:  # a group whose records made no token has none
            row.speedup = summary[ar].ms_per_token / s.ms_per_token
            ratios = [p["ar"] / p[m] for p in per_prompt[b].values() if "ar" in p and m in p and p[m] > 0]
            if ratios:
                row.speedup_per_prompt = SpeedupPerPrompt(
                    median=statistics.median(ratios), min=min(ratios), max=max(ratios), n=len(ratios)
                )
        out[key] = row
    return out
