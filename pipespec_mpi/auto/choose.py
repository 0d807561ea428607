"""The choice, pure: candidate pipelines, their predicted speed, the winner, the config that runs it.

Notation (per candidate pipeline P = (s_0, ..., s_{k-1} = target) of the hierarchy's stages):
  cost_P[s](n)   measured seconds of stage s's forward over n new tokens while P's other stages
                 run beside it, each rank with threads(k) threads
  a(x -> y)      agreement: over the positions of the target's greedy paths where x proposes,
                 the fraction where x's token equals y's (y = target: the path's own token)
  ms_P           the simulator's ms/token for P: the real stage loop replaying, prompt by
                 prompt, what each drafter proposed at each position of the target's path (a
                 lookup stage: its whole runs, ``run_trace``), i.i.d. a(s_j -> s_j+1) off the
                 path, each prompt's prefill included (a fifth of a 64-token HumanEval job's
                 time on the 2-core EPYC: leaving it out overstates every speedup)
AR is the target alone with threads(1): ``ms_AR``. The plan is the fastest (method, P, window)
if ms_AR / ms >= 1 + margin, else AR: speculation must be predicted to pay by a margin.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from pipespec_mpi import simulate as sim
from pipespec_mpi.auto.measure import Agreement
from pipespec_mpi.config import DRAFTER_KINDS, AppConfig, DecodeConfig, HierarchyConfig, StageConfig

Pipeline = tuple[int, ...]  # stage indices of the candidate hierarchy, smallest first, target last


def candidates(stages: Sequence[StageConfig], max_stages: int) -> list[Pipeline]:
    """Every ordered subset of the stages that ends with the last (the target): a lookup stage
    only first, a copy only with the stage it copies."""
    last = len(stages) - 1
    out = []
    for k in range(0, min(max_stages, len(stages))):
        for drafters in itertools.combinations(range(last), k):
            p = (*drafters, last)
            if any(stages[i].kind in DRAFTER_KINDS for i in p[1:]):
                continue
            if any(stages[i].copy_of is not None and stages[i].copy_of not in p for i in p):
                continue
            out.append(p)
    return out


def threads_per_rank(k: int, replicas: int, cores: int, ranks_on_node: int, bound: bool) -> int:
    """Threads of each rank when k-stage pipelines run: the node's cores split among its active
    ranks, or, when the launcher binds each rank to its own cores (``bound``), all of those."""
    if bound:
        return cores
    active = min(ranks_on_node, k * replicas)
    return max(1, cores // active)


def agreement_rate(ag: Agreement, drafter: int, verifier: int) -> float | None:
    """a(drafter -> verifier); None when the drafter never proposes. The last stage's token is the
    path's (its greedy output), every other stage's its teacher-forced argmax."""
    hits = agree = 0
    for p in range(len(ag.paths)):
        theirs = ag.tokens_of(verifier, p)
        for i, tok in enumerate(ag.first(drafter, p)):
            if tok >= 0:
                hits += 1
                agree += tok == theirs[i]
    return agree / hits if hits else None


def lookup_rates(ag: Agreement, stage: int) -> tuple[float, float]:
    """A lookup stage's (hit rate, chain rate): how often it finds a continuation, and how often
    it finds one again at the position right after one it found."""
    hits = chained = after_hit = n = 0
    for runs in ag.proposals[stage]:
        for i, run in enumerate(runs):
            n += 1
            hits += bool(run)
            if i and runs[i - 1]:
                after_hit += 1
                chained += bool(run)
    hit = hits / n if n else 0.0
    return hit, (chained / after_hit if after_hit else hit)


def matched(run: Sequence[int], theirs: Sequence[int], at: int) -> int:
    """How many leading tokens of ``run``, proposed at position ``at``, equal ``theirs``."""
    m = 0
    while m < len(run) and at + m < len(theirs) and run[m] == theirs[at + m]:
        m += 1
    return m


def run_trace(
    runs: Sequence[Sequence[int]], theirs: Sequence[int], method: str, window: int
) -> dict[int, bool]:
    """A lookup stage's verdicts along the path, proposal by proposal as the loop meets them.

    A lookup proposal is a run copied from earlier text: it matches for a while, then stops
    matching, so its tokens' verdicts are not independent. Walk the path as the verifier commits
    it: a proposal at s of length L matching m tokens is accepted up to min(m, cap), where cap is
    SD's window or L; the verifier adds one token (its correction, or SD's bonus), or, under
    PipeSpec, after a fully matching run the lookup goes on from s + L itself.
    """
    trace: dict[int, bool] = {}
    s = 0
    while s < len(theirs):
        run = list(runs[s])[: window if method == "sd" else None]
        if not run:
            s += 1  # a miss: the verifier steps alone
            continue
        m = matched(run, theirs, s)
        trace.update({s + q: True for q in range(m)})
        if m < len(run):
            trace[s + m] = False
            s += m + 1
        else:
            s += m if method == "pipespec" else m + 1
    return trace


@dataclass(frozen=True)
class Measured:
    """What the choice is computed from (cached as JSON)."""

    stages: tuple[str, ...]  # candidate stage names, smallest first
    kinds: tuple[str, ...]
    max_proposal: tuple[int, ...]
    # P -> per stage {points: [(n, s)], prefill_s, context, per_sequence_s}
    costs: Mapping[Pipeline, Sequence[Mapping]]
    threads: Mapping[int, int]  # k -> threads per rank
    agreement: Agreement

    def to_json(self) -> dict:
        return {
            "stages": list(self.stages), "kinds": list(self.kinds), "max_proposal": list(self.max_proposal),
            "costs": [[list(p), pts] for p, pts in self.costs.items()],
            "threads": {str(k): v for k, v in self.threads.items()},
            "agreement": self.agreement.to_json(),
        }  # fmt: skip

    @classmethod
    def from_json(cls, node: dict) -> Measured:
        return cls(
            stages=tuple(node["stages"]),
            kinds=tuple(node["kinds"]),
            max_proposal=tuple(node["max_proposal"]),
            costs={tuple(p): pts for p, pts in node["costs"]},
            threads={int(k): v for k, v in node["threads"].items()},
            agreement=Agreement.from_json(node["agreement"]),
        )


def profiles(m: Measured, p: Pipeline) -> list[sim.LatencyProfile]:
    out = []
    for s, cost in zip(p, m.costs[p]):
        points = tuple((float(n), float(t)) for n, t in cost["points"])
        prefill = cost.get("prefill_s", 0.0) / cost["context"] if cost.get("context") else 0.0
        if m.kinds[s] in DRAFTER_KINDS:
            hit, chain = lookup_rates(m.agreement, s)
            out.append(sim.LatencyProfile(
                name=m.stages[s], points=points, kind="lookup", max_proposal=m.max_proposal[s],
                lookup_hit_rate=hit, lookup_chain_rate=chain,
            ))  # fmt: skip
        else:
            out.append(sim.LatencyProfile(name=m.stages[s], points=points, prefill_per_token_s=prefill,
                                          per_sequence_s=float(cost.get("per_sequence_s", 0.0))))  # fmt: skip
    return out


def rates(m: Measured, p: Pipeline) -> tuple[float, ...] | None:
    got = [agreement_rate(m.agreement, a, b) for a, b in zip(p, p[1:])]
    return None if any(r is None for r in got) else tuple(float(r) for r in got)


def replay(m: Measured, p: Pipeline, prompt: int, method: str, window: int) -> sim.Acceptance | None:
    """Acceptance for pipeline ``p`` on calibration prompt ``prompt``: per adjacent pair, the
    drafter's verdicts along the path (a model: where its argmax agrees with its verifier's; a
    lookup stage: ``run_trace``), the lookup stage's proposal lengths; i.i.d. rates elsewhere."""
    iid = rates(m, p)
    if iid is None:
        return None
    ag = m.agreement
    traces = []
    for a, b in zip(p, p[1:]):
        theirs = ag.tokens_of(b, prompt)
        if m.kinds[a] in DRAFTER_KINDS:
            traces.append(run_trace(ag.proposals[a][prompt], theirs, method, window))
        else:
            traces.append({i: tok == theirs[i] for i, tok in enumerate(ag.first(a, prompt)) if tok >= 0})
    lookup = None
    if m.kinds[p[0]] in DRAFTER_KINDS:
        lookup = {i: len(run) for i, run in enumerate(ag.proposals[p[0]][prompt])}
    return sim.Acceptance(rates=iid, traces=tuple(traces), lookup=lookup)


def simulated_ms(m: Measured, p: Pipeline, cfg: sim.SimConfig, seeds: Sequence[int]) -> float | None:
    """ms/token of ``p`` over the calibration prompts (each replayed, ``seeds`` times). Batched
    (``cfg.batch_size`` B): B prompts at a time, the calibration prompts taken in turn (B of
    them from prompt j on, for each j), and the time per token is the batch's wall over all its
    slots' tokens (1000 / tokens/s)."""
    profs = profiles(m, p)
    window = cfg.decode.window(cfg.method)
    accs = []
    for k in range(len(m.agreement.paths)):
        acc = replay(m, p, k, cfg.method, window) if len(p) > 1 else sim.Acceptance(rates=())
        if acc is None:
            return None
        accs.append(acc)
    n_prompts, b = len(accs), cfg.batch_size
    wall = tokens = 0.0
    for k in range(n_prompts):
        wave = [(k + j) % n_prompts for j in range(b)]
        n = max(1, *(len(m.agreement.paths[j]) for j in wave))
        prompt_len = m.agreement.prompt_lens[k] if m.agreement.prompt_lens else 0
        for s in seeds:
            decode = replace(cfg.decode, max_new_tokens=n)
            run = replace(cfg, decode=decode, seed=s, prompt_len=prompt_len, include_prefill=bool(prompt_len))
            r = sim.simulate(profs, accs[k] if b == 1 else [accs[j] for j in wave], run)
            wall += r.wall_s
            tokens += sum(x.n_tokens for x in r.slots) if r.slots else r.n_tokens
    return 1000.0 * wall / tokens


@dataclass(frozen=True)
class Option:
    method: str
    pipeline: tuple[str, ...]  # stage names
    window: int  # PipeSpec's lookahead or SD's window; 0 for AR
    ms_per_token: float  # batched: 1000 / tokens/s of all the batch's sequences
    speedup: float  # over AR at batch 1
    run_ahead: int = 0  # PipeSpec's max_run_ahead (0: the configured one)
    batch_size: int = 1
    policy: str = "static"  # PipeSpec's decode.policy (adaptive: ``window`` is unused, 0)


@dataclass(frozen=True)
class Plan:
    """The choice and why: the options tried (best first), the predicted AR, the margin."""

    chosen: Option
    best_speculative: Option | None
    ar: Option
    margin: float
    reason: str
    options: tuple[Option, ...] = field(default=())
    threads: Mapping[int, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d["threads"] = {str(k): v for k, v in self.threads.items()}
        return d


def predict(
    m: Measured,
    decode: DecodeConfig,
    max_stages: int,
    margin: float,
    lookaheads: Sequence[int] = (0, 1, 2, 4),
    sd_windows: Sequence[int] = (1, 2, 3, 4, 6),
    run_aheads: Sequence[int] = (4, 8, 16),
    seeds: Sequence[int] = (0,),  # replayed prompts: only off-path verdicts are drawn
    batch_sizes: Sequence[int] = (1,),
) -> Plan:
    """Simulate every candidate pipeline with every window (and, for PipeSpec, run-ahead bound);
    choose (see the module's notation). With ``batch_sizes``, also each (pipeline, method)'s best
    setting at batch 1 batched at every other size, and AR at every size: the choice is the
    highest throughput, speculative only where it beats the best AR by the margin."""
    n = len(m.stages)
    base = sim.SimConfig(decode=decode, include_prefill=False)
    ar_ms = simulated_ms(m, (n - 1,), replace(base, method="ar"), seeds[:1])
    ars = [Option("ar", (m.stages[-1],), 0, ar_ms, 1.0)]
    for b in sorted(set(batch_sizes) - {1}):
        ms = simulated_ms(m, (n - 1,), replace(base, method="ar", batch_size=b), seeds[:1])
        ars.append(Option("ar", (m.stages[-1],), 0, ms, ar_ms / ms, batch_size=b))
    ar = min(ars, key=lambda o: o.ms_per_token)
    options = []
    for p in m.costs:
        if len(p) < 2 or len(p) > max_stages or rates(m, p) is None:
            continue
        names = tuple(m.stages[i] for i in p)
        settings = [("sd", w, decode.max_run_ahead, "static") for w in sd_windows]
        settings += [("pipespec", w, r, "static") for w in lookaheads for r in run_aheads]
        settings += [("pipespec", 0, r, "adaptive") for r in run_aheads]  # speculative/goodput.py
        for method, w, ahead, policy in settings:
            if w > decode.max_verify or w > ahead or (method == "sd" and w > decode.max_run_ahead):
                continue
            key = "sd_window" if method == "sd" else "lookahead"
            d = replace(decode, **{key: w, "max_run_ahead": ahead, "policy": policy})
            ms = simulated_ms(m, p, replace(base, method=method, decode=d), seeds)
            options.append(
                Option(method, names, w, ms, ar_ms / ms, ahead if method == "pipespec" else 0, policy=policy)
            )
    options.sort(key=lambda o: o.ms_per_token)
    batched = []
    for b in sorted(set(batch_sizes) - {1}):
        tops = {}
        for o in options:  # each (pipeline, method)'s best setting at batch 1
            tops.setdefault((o.pipeline, o.method), o)
        for o in tops.values():
            p = tuple(m.stages.index(name) for name in o.pipeline)
            key = "sd_window" if o.method == "sd" else "lookahead"
            d = replace(decode, **{key: o.window, "max_run_ahead": o.run_ahead or decode.max_run_ahead,
                                   "policy": o.policy})  # fmt: skip
            run = replace(base, method=o.method, decode=d.for_batch(b), batch_size=b)
            ms = simulated_ms(m, p, run, seeds)
            batched.append(replace(o, ms_per_token=ms, speedup=ar_ms / ms, batch_size=b))
    options = sorted(options + batched, key=lambda o: o.ms_per_token)
    best = options[0] if options else None
    # with batch sizes to choose from, throughputs are compared: the best AR is at its best size
    by_throughput = len(ars) > 1
    vs = f"the best AR's throughput (batch {ar.batch_size})" if by_throughput else "AR"
    at = lambda o: f" at batch {o.batch_size}" if by_throughput else ""  # noqa: E731
    if best is not None and best.ms_per_token * (1 + margin) <= ar.ms_per_token:
        gain = ar.ms_per_token / best.ms_per_token
        chosen = best
        reason = f"predicted {gain:.2f}x {vs}" + (f" with {best.method}{at(best)}" if by_throughput else "")
        reason += f" (>= 1 + margin {margin})"
    else:
        chosen = ar
        reason = (
            f"no speculative option is predicted to beat {vs} by the margin {margin} "
            f"(best: {best.method} {' -> '.join(best.pipeline)}{at(best)} at "
            f"{ar.ms_per_token / best.ms_per_token:.2f}x)"
            if best
            else "no speculative option to simulate (no drafter proposes along the calibration paths)"
        )
    options_all = sorted([*ars, *options], key=lambda o: o.ms_per_token)
    if len(ars) == 1:
        options_all = [ar, *options]  # batch 1 alone: AR first, as the table has always shown it
    return Plan(chosen, best, ar, margin, reason, tuple(options_all), dict(m.threads))


def realize(cfg: AppConfig, plan: Plan, bound: bool) -> AppConfig:
    """The config that runs the plan: its stages (copies re-pointed, threads set unless the
    launcher binds ranks), its method and window. In ``run.mode=benchmark`` the hierarchy is the
    best speculative option's, so that every method of the comparison can run on it."""
    opt = plan.chosen
    if cfg.run.mode == "benchmark" and plan.best_speculative is not None:
        opt = plan.best_speculative
    h = cfg.hierarchy
    by_name = {s.name: i for i, s in enumerate(h.stages)}
    index = [by_name[name] for name in opt.pipeline]
    threads = None if bound else plan.threads.get(len(index))
    stages = []
    for i in index:
        st = h.stages[i]
        if st.copy_of is not None:
            st = replace(st, copy_of=index.index(st.copy_of))
        stages.append(replace(st, threads=st.threads or threads))
    hier = HierarchyConfig(
        name=f"{h.name}[{'+'.join(opt.pipeline)}]", stages=tuple(stages), tokenizer=h.tokenizer,
        tiny=h.tiny, choose=False,
    )  # fmt: skip
    decode = cfg.decode
    if opt.method == "sd":
        decode = replace(decode, sd_window=opt.window)
    elif opt.method == "pipespec":
        decode = replace(decode, lookahead=opt.window, max_run_ahead=opt.run_ahead or decode.max_run_ahead,
                         policy=opt.policy)  # fmt: skip
    method = plan.chosen.method if cfg.run.mode == "single" else cfg.method
    if cfg.run.mode == "single":
        decode = replace(decode, batch_size=plan.chosen.batch_size)
    run = cfg.run
    if len(stages) == 1:  # the target alone: nothing but AR can run on it
        run = replace(run, methods=("ar",))
    return replace(cfg, hierarchy=hier, decode=decode, method=method, run=run)


def table(plan: Plan, top: int = 8) -> str:
    lines = [
        f"{'method':<9} {'pipeline':<58} {'win':>3} {'ahead':>5} {'batch':>5} {'ms/token':>9} {'vs AR':>7}"
    ]
    for o in plan.options[: top + 1]:
        mark = " <- chosen" if o == plan.chosen else ""
        win = "-" if o.method == "ar" else "ad" if o.policy == "adaptive" else str(o.window)
        ahead = str(o.run_ahead) if o.run_ahead else "-"
        path = " -> ".join(o.pipeline)
        lines.append(
            f"{o.method:<9} {path:<58} {win:>3} {ahead:>5} {o.batch_size:>5} {o.ms_per_token:>9.2f}"
            f" {o.speedup:>6.2f}x{mark}"
        )
    lines.append(
        "ms/token of a batch: 1000 / tokens/s of all its sequences; vs AR: over AR at batch 1; "
        "win ad: decode.policy=adaptive"
    )
    lines.append(f"choice: {plan.reason}")
    return "\n".join(lines)
