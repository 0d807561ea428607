"""What a real run recorded, read as simulator inputs: forward-cost profiles, overheads, acceptance
and lookup traces, latencies (fit.py fits them into one ``RunFit``).

A run directory holds results.jsonl: one record per (prompt, method), each with per-stage
timelines ([t0, t1, kind, n_tokens, context_len], kind in prefill/draft/verify/own/wait; the
context is the one after the action's commit) and verify traces ([n_proposed, n_accepted]).
Note: a "wait" event is closed after the action that ends it, so its t1 overlaps that action;
only its start is used here, and a wait is taken to end where the next action starts.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.records import RESULTS, Record, read_records
from pipespec_mpi.simulate.inputs import LatencyProfile
from pipespec_mpi.stage.stats import StageStats

_ACTIONS = ("draft", "verify", "own")


def load_records(run_dir: str | Path) -> list[Record]:
    """The run's non-warm-up records of one sequence at a time, in file order (a batched
    record's forwards served other sequences too: its timeline is not one stage's cost; batched
    runs are predicted from the planner's measured costs, auto/measured.py)."""
    path = Path(run_dir) / RESULTS
    if not path.exists():
        raise FileNotFoundError(f"{path}: no {RESULTS} (is {run_dir} a run directory?)")
    return [r for r in read_records(path) if not r.warmup and r.batch_size == 1]


def _events(stage_rec: StageStats) -> list[list]:
    return sorted(stage_rec.timeline, key=lambda e: (e[0], e[1]))


def _offsets(rec: Record) -> list[float] | None:
    """Per stage: its timeline's start on the last stage's clock, from the records' absolute
    ``t0_perf_counter`` (one clock for the processes of a node); None when a stage lacks it
    (older records: 0)."""
    t0 = [sr.t0_perf_counter for sr in rec.stages]
    if any(t <= 0 for t in t0):
        return None
    return [float(t) - float(t0[-1]) for t in t0]


def _stage_events(rec: Record, stage: int) -> list[list]:
    """A stage's timeline on the common clock (as recorded when the run has no common clock)."""
    ev = _events(rec.stages[stage])
    off = _offsets(rec)
    if not off or off[stage] == 0.0:
        return ev
    d = off[stage]
    return [[e[0] + d, e[1] + d, *e[2:]] for e in ev]


def _lsq_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys on xs; 0 with fewer than two points or all xs equal."""
    try:
        return statistics.linear_regression(xs, ys).slope
    except statistics.StatisticsError:
        return 0.0


def fit_profile(stage_recs: Sequence[StageStats], name: str, kind: str = "model") -> LatencyProfile:
    """A stage's latency profile from its timeline events across records.

    forward time: mean per number of tokens n, plus a context slope fitted within each n
    (pooled); overhead: mean gap between the end of an action and the stage's next decision
    (the next action or the start of a wait); prefill: linear in the prompt length.
    """
    by_n: dict[int, list[tuple[float, float]]] = {}
    gaps: list[float] = []  # action -> action: the loop's cost between back-to-back actions
    idle_gaps: list[float] = []  # action -> start of a wait (used only when no gap is seen)
    pre: list[tuple[float, float]] = []
    for sr in stage_recs:
        ev = _events(sr)
        for e in ev:
            if e[2] in _ACTIONS:
                by_n.setdefault(int(e[3]), []).append((float(e[4]), e[1] - e[0]))
            elif e[2] == "prefill":
                pre.append((float(e[3]), e[1] - e[0]))
        for a, b in zip(ev, ev[1:]):
            if a[2] in _ACTIONS and b[2] in _ACTIONS:
                gaps.append(max(0.0, b[0] - a[1]))
            elif a[2] in _ACTIONS and b[2] == "wait":
                idle_gaps.append(max(0.0, b[0] - a[1]))
    if not by_n:
        raise ValueError(f"stage {name}: no forward events to fit a latency profile from")
    # context slope, pooled within groups of equal n
    dx, dy = [], []
    for obs in by_n.values():
        mc = sum(c for c, _ in obs) / len(obs)
        md = sum(d for _, d in obs) / len(obs)
        dx += [c - mc for c, _ in obs]
        dy += [d - md for _, d in obs]
    slope = max(0.0, _lsq_slope(dx, dy)) if len(dx) > 2 else 0.0
    all_ctx = [c for obs in by_n.values() for c, _ in obs]
    ctx_ref = sum(all_ctx) / len(all_ctx)
    points = []
    for n, obs in sorted(by_n.items()):
        mc = sum(c for c, _ in obs) / len(obs)
        md = sum(d for _, d in obs) / len(obs)
        points.append((float(n), max(1e-7, md - slope * (mc - ctx_ref))))
    if pre:
        ps = _lsq_slope([n for n, _ in pre], [d for _, d in pre])
        ps = max(0.0, ps)
        base = sum(d for _, d in pre) / len(pre) - ps * sum(n for n, _ in pre) / len(pre)
        if base < 0:
            base, ps = 0.0, sum(d for _, d in pre) / max(1.0, sum(n for n, _ in pre))
    else:
        base, ps = 0.0, 0.0
    return LatencyProfile(
        name=name,
        points=tuple(points),
        per_ctx_s=slope,
        ctx_ref=ctx_ref,
        overhead_s=statistics.fmean(gaps or idle_gaps or [0.0]),
        prefill_base_s=base,
        prefill_per_token_s=ps,
        kind=kind,
    )


def _forwards(rec: Record, stage: int) -> list[tuple[float, float]]:
    return [(e[0], e[1]) for e in _stage_events(rec, stage) if e[2] in _ACTIONS or e[2] == "prefill"]


def overhead_samples(
    rec: Record, stage: int, blocking_reads: bool = False
) -> tuple[list[float], list[float]]:
    """The loop's own cost after an action of a stage (publish, send, the next header read and
    decision), as (gaps to a next action, gaps to the start of a wait). With ``blocking_reads``
    (runs made with the old MPI RMA window, whose header read of a computing stage waited for its
    forward; the simulator models that wait separately) each gap is less the time a neighbour it
    reads spent in a forward meanwhile: every iteration reads the downstream; a stage that finds
    nothing to do also reads its upstream's idle flag before it starts waiting."""
    st = rec.stages
    down: list[tuple[float, float]] = []
    both: list[tuple[float, float]] = []
    if blocking_reads:
        down = _union(_forwards(rec, stage + 1)) if stage + 1 < len(st) else []
        both = _union(down + (_forwards(rec, stage - 1) if stage > 0 else []))
    ev = [e for e in _stage_events(rec, stage) if e[2] in _ACTIONS or e[2] == "wait"]
    to_act: list[float] = []
    to_wait: list[float] = []
    for a, b in zip(ev, ev[1:]):
        if a[2] in _ACTIONS:
            t0, t1 = a[1], b[0]
            acting = b[2] in _ACTIONS
            busy = down if acting else both
            overlap = sum(max(0.0, min(t1, e1) - max(t0, e0)) for e0, e1 in busy)
            (to_act if acting else to_wait).append(max(0.0, t1 - t0 - overlap))
    return to_act, to_wait


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _committed_series(rec: Record, stage: int) -> list[tuple[float, int]]:
    """(action end, committed length after it) for a stage, in time order."""
    p = len(rec.prompt_ids)
    return [(e[1], int(e[4]) - p) for e in _stage_events(rec, stage) if e[2] in _ACTIONS]


def _verify_bases(rec: Record, stage: int) -> list[tuple[list, int, int]]:
    """(event, base position, n_accepted) for each verification of a stage, in order."""
    p = len(rec.prompt_ids)
    cap = int(rec.n_new_tokens or rec.max_new_tokens or 10**9)
    sr = rec.stages[stage]
    ver = [e for e in sr.timeline if e[2] == "verify"]  # recording order
    out = []
    for e, (_n, a) in zip(ver, sr.verify_trace):
        after = int(e[4]) - p
        committed = int(a) + 1
        if after >= cap:  # the commit may have been cut at the cap
            committed = min(committed, after)
        out.append((e, max(0, after - committed), int(a)))
    return out


def agreement_trace(rec: Record, stage: int) -> dict[int, bool]:
    """Pair (stage-1 -> stage): output position -> whether the drafter's token agreed with the
    verifier's, from the verifier's verifications (later verifications win) and, where those say
    nothing (the verifier's own token: a bonus after all it verified, or an own step), from what
    the drafter did next (``_reactions``)."""
    agree: dict[int, bool] = {}
    for e, b, a in _verify_bases(rec, stage):
        n = int(e[3])
        for q in range(a):
            agree[b + q] = True
        if a < n:
            agree[b + a] = False
    for pos, verdict in _reactions(rec, stage).items():
        agree.setdefault(pos, verdict)
    return agree


def _action_spans(rec: Record, stage: int) -> list[tuple[float, float, int, int]]:
    """(start, end, base, length after) of a stage's actions on the common clock."""
    p = len(rec.prompt_ids)
    bases = {id(e): b for e, b, _ in _verify_bases(rec, stage)}
    out = []
    for e in _events(rec.stages[stage]):
        if e[2] not in _ACTIONS or (e[2] == "verify" and id(e) not in bases):
            continue
        after = int(e[4]) - p
        base = bases[id(e)] if e[2] == "verify" else after - int(e[3])
        out.append((e[0], e[1], base, after))
    off = _offsets(rec)
    d = off[stage] if off else 0.0
    return [(t0 + d, t1 + d, b, n) for t0, t1, b, n in out]


def _reactions(rec: Record, stage: int) -> dict[int, bool]:
    """The drafter's (stage-1) token at the position of the verifier's own token, judged by what
    the drafter did next. A drafter that was beyond that position and next works from right after
    it had adopted the verifier's token there: they disagreed; one that works further on agreed.
    Needs the records' common clock."""
    if _offsets(rec) is None:
        return {}
    ups = _action_spans(rec, stage - 1)
    up_ends = [t1 for _, t1, _, _ in ups]
    up_starts = [t0 for t0, _, _, _ in ups]
    accepted = {id(e): (b, a) for e, b, a in _verify_bases(rec, stage)}
    p = len(rec.prompt_ids)
    off = _offsets(rec)[stage]
    out: dict[int, bool] = {}
    for e in _events(rec.stages[stage]):
        if e[2] == "own":
            own_pos = int(e[4]) - p - 1
        elif e[2] == "verify" and id(e) in accepted and accepted[id(e)][1] == int(e[3]):
            b, a = accepted[id(e)]
            own_pos = b + a  # the bonus after every proposal was accepted
        else:
            continue
        t1 = e[1] + off
        i = bisect.bisect_right(up_ends, t1) - 1
        j = bisect.bisect_left(up_starts, t1)
        if i < 0 or j >= len(ups) or ups[i][3] <= own_pos + 1:
            continue  # the drafter had no token there yet, or never worked again
        base = ups[j][2]
        if base == own_pos + 1:
            out[own_pos] = False
        elif base > own_pos + 1:
            out[own_pos] = True
    return out


def lookup_trace(rec: Record) -> dict[int, int]:
    """A lookup stage 0's hits and misses by position: base position -> the longest proposal it
    drafted from there, or 0 where the next stage took a step of its own from there (its
    upstream was idle: the lookup found no continuation) and the lookup never drafted from it."""
    st = rec.stages
    if len(st) < 2:
        return {}
    p = len(rec.prompt_ids)
    seen: dict[int, int] = {}
    for e in _events(st[0]):
        if e[2] == "draft":
            b = int(e[4]) - p - int(e[3])
            seen[b] = max(seen.get(b, 0), int(e[3]))
    for e in _events(st[1]):
        if e[2] == "own":
            seen.setdefault(int(e[4]) - p - 1, 0)
    return seen


def _lookup_chain_rate(recs: Sequence[Record]) -> float | None:
    """How often a lookup stage 0 that had room after a proposal found a continuation of it (its
    next draft starts where the proposal ended, before it adopted anything); None without a
    common clock (the room depends on the downstream's length at that moment)."""
    chained = tried = 0
    for rec in recs:
        if _offsets(rec) is None or len(rec.stages) < 2 or rec.method != "pipespec":
            return None  # (SD: the drafter proposes only what the verifier asks for)
        p = len(rec.prompt_ids)
        cap = rec.n_new_tokens
        bound = rec.max_run_ahead or DecodeConfig.max_run_ahead
        down = _committed_series(rec, 1)
        down_t = [t for t, _ in down]
        dr = [e for e in _stage_events(rec, 0) if e[2] == "draft"]
        for k, a in enumerate(dr):
            end = int(a[4]) - p
            i = bisect.bisect_right(down_t, a[1]) - 1
            down_len = down[i][1] if i >= 0 else 0
            if end >= cap or end - down_len >= bound:
                continue  # no room: the stage waits, it does not look up
            nxt = dr[k + 1] if k + 1 < len(dr) else None
            j = bisect.bisect_right(down_t, nxt[0]) - 1 if nxt else -1
            if nxt is not None and j != i:
                continue  # the downstream acted in between: the next lookup may follow an adoption
            tried += 1
            chained += nxt is not None and int(nxt[4]) - p - int(nxt[3]) == end
    return chained / tried if tried else None


_CLOCK_SLACK_S = 0.01  # the most two ranks' barrier exits are assumed apart (records without a clock)


def latency_samples(rec: Record, pair: int, offset_s: float = 0.0) -> tuple[list[float], list[float]]:
    """Delays observed across pair (pair -> pair+1) in one record, as (down, up), each measured
    on two ranks' clocks: the common one when the records carry ``t0_perf_counter``, else each
    rank's own, stage pair+1's shifted by ``offset_s`` (see ``calibrate``).

    down (proposals): a verifier that waited starts verifying; the delay is measured from the
    end of the upstream action that completed the proposals it waited for: the upstream's last
    action before the verification, if it ended during the wait (proposals sent before the wait
    were of an older epoch, or not enough).
    up (headers), only where the upstream is the first stage: after each verification or own
    step of the downstream, the delay to the drafter's first draft that continues the
    downstream's new tokens (a draft starting at the downstream's committed length).
    """
    down: list[float] = []
    up: list[float] = []
    look = rec.window or 0
    method = rec.method
    p = len(rec.prompt_ids)
    ups = _committed_series(rec, pair)
    up_ends = [t for t, _ in ups]
    bases = _verify_bases(rec, pair + 1)
    starts = {id(e): b for e, b, _ in bases}
    off = _offsets(rec)
    dv = off[pair + 1] if off else offset_s
    ev = _events(rec.stages[pair + 1])
    for w, v in zip(ev, ev[1:]):
        if w[2] != "wait" or v[2] != "verify" or id(v) not in starts:
            continue
        # without a common clock the triggering action may seem to end after the verification
        # started: take the upstream action ending nearest to it (the sample may be negative)
        i = bisect.bisect_right(up_ends, v[0] + dv + (0.0 if off else _CLOCK_SLACK_S)) - 1
        if i >= 0 and up_ends[i] >= w[0] + dv:
            if (
                i + 1 < len(up_ends)
                and not off
                and abs(up_ends[i + 1] - v[0] - dv) < abs(up_ends[i] - v[0] - dv)
            ):
                i += 1
            down.append(v[0] + dv - up_ends[i])
    if pair != 0:
        return down, up
    drafts = [e for e in _stage_events(rec, 0) if e[2] in _ACTIONS]
    d0 = [d[0] for d in drafts]
    acts = [[e[0] + dv, e[1] + dv, *e[2:]] for e in ev if e[2] in ("verify", "own")]
    # SD with a stage after the verifier: the verifier asks for more only while its own
    # downstream still wants tokens; otherwise the drafter waits for that stage, not for a header
    demand = _committed_series(rec, 2) if method == "sd" and len(rec.stages) > 2 else None
    for k, v in enumerate(acts):
        length = int(v[4]) - p
        if demand is not None:
            i = bisect.bisect_right([t for t, _ in demand], v[1]) - 1
            if length >= (demand[i][1] if i >= 0 else 0) + look:
                continue
        hi = acts[k + 1][0] if k + 1 < len(acts) else math.inf
        # on a common clock only a draft after the header change can be a reaction to it (one that
        # started earlier from the same length found its own tokens confirmed); without one the
        # clocks' skew is estimated from these samples, so they start at the action's start
        for d in drafts[bisect.bisect_left(d0, v[1] if off else v[0]) :]:
            if d[0] > hi:
                break
            if int(d[4]) - p - int(d[3]) == length:  # the draft continues from the new tokens
                up.append(d[0] - v[1])
                break
    return down, up


def _quantile(xs: Sequence[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(q * (len(xs) - 1))))]
