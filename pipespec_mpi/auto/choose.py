"""The choice, pure: candidate pipelines, their predicted speed, the winner, the config that runs it.

Notation (per candidate pipeline P = (s_0, ..., s_{k-1} = target) of the hierarchy's stages):
  cost_P[s](n)   measured seconds of stage s's forward over n new tokens while P's other stages
                 run beside it, each rank with threads(k) threads
  a(x -> y)      agreement: over the positions of the target's greedy paths where x proposes,
                 the fraction where x's token equals y's (y = target: the path's own token)
  ms_P           the simulator's ms/token for P (real stage loop, i.i.d. acceptance a(s_j -> s_j+1))
AR is the target alone with threads(1): ``ms_AR``. The plan is the fastest (method, P, window)
if ms_AR / ms >= 1 + margin, else AR: speculation must be predicted to pay by a margin.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

from pipespec_mpi import simulate as sim
from pipespec_mpi.auto.measure import Agreement
from pipespec_mpi.config import AppConfig, DecodeConfig, HierarchyConfig, StageConfig

Pipeline = tuple[int, ...]  # stage indices of the candidate hierarchy, smallest first, target last


def candidates(stages: Sequence[StageConfig], max_stages: int) -> list[Pipeline]:
    """Every ordered subset of the stages that ends with the last (the target): a lookup stage
    only first, a copy only with the stage it copies."""
    last = len(stages) - 1
    out = []
    for k in range(0, min(max_stages, len(stages))):
        for drafters in itertools.combinations(range(last), k):
            p = (*drafters, last)
            if any(stages[i].kind == "prompt_lookup" for i in p[1:]):
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
    last = len(ag.proposals) - 1
    hits = agree = 0
    for p, path in enumerate(ag.paths):
        mine = ag.proposals[drafter][p]
        theirs = path if verifier == last else ag.proposals[verifier][p]
        for i, tok in enumerate(mine):
            if tok >= 0:
                hits += 1
                agree += tok == theirs[i]
    return agree / hits if hits else None


def lookup_rates(ag: Agreement, stage: int) -> tuple[float, float]:
    """A lookup stage's (hit rate, chain rate): how often it finds a continuation, and how often
    it finds one again at the position right after one it found."""
    hits = chained = after_hit = n = 0
    for lengths in ag.lengths[stage]:
        for i, m in enumerate(lengths):
            n += 1
            hits += m > 0
            if i and lengths[i - 1] > 0:
                after_hit += 1
                chained += m > 0
    hit = hits / n if n else 0.0
    return hit, (chained / after_hit if after_hit else hit)


@dataclass(frozen=True)
class Measured:
    """What the choice is computed from (cached as JSON)."""

    stages: tuple[str, ...]  # candidate stage names, smallest first
    kinds: tuple[str, ...]
    max_proposal: tuple[int, ...]
    costs: Mapping[Pipeline, Sequence[Sequence[Sequence[float]]]]  # P -> per stage (n, s) points
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
    for s, pts in zip(p, m.costs[p]):
        points = tuple((float(n), float(t)) for n, t in pts)
        if m.kinds[s] == "prompt_lookup":
            hit, chain = lookup_rates(m.agreement, s)
            out.append(sim.LatencyProfile(
                name=m.stages[s], points=points, kind="lookup", max_proposal=m.max_proposal[s],
                lookup_hit_rate=hit, lookup_chain_rate=chain,
            ))  # fmt: skip
        else:
            out.append(sim.LatencyProfile(name=m.stages[s], points=points))
    return out


def rates(m: Measured, p: Pipeline) -> tuple[float, ...] | None:
    got = [agreement_rate(m.agreement, a, b) for a, b in zip(p, p[1:])]
    return None if any(r is None for r in got) else tuple(float(r) for r in got)


@dataclass(frozen=True)
class Option:
    method: str
    pipeline: tuple[str, ...]  # stage names
    window: int  # PipeSpec's lookahead or SD's window; 0 for AR
    ms_per_token: float
    speedup: float


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
    seeds: Sequence[int] = (0, 1, 2),
) -> Plan:
    """Simulate every candidate pipeline with every window; choose (see the module's notation)."""
    n = len(m.stages)
    target = (n - 1,)
    base = sim.SimConfig(decode=decode, include_prefill=False)
    ar_ms = sim.mean_ms_per_token(profiles(m, target), (), replace(base, method="ar"), seeds[:1])
    ar = Option("ar", (m.stages[-1],), 0, ar_ms, 1.0)
    options = []
    for p in m.costs:
        if len(p) < 2 or len(p) > max_stages:
            continue
        r = rates(m, p)
        if r is None:
            continue
        profs = profiles(m, p)
        for method, windows in (("sd", sd_windows), ("pipespec", lookaheads)):
            for w in windows:
                if w > decode.max_verify or w > decode.max_run_ahead:
                    continue
                key = "sd_window" if method == "sd" else "lookahead"
                cfg = replace(base, method=method, decode=replace(decode, **{key: w}))
                ms = sim.mean_ms_per_token(profs, r, cfg, seeds)
                options.append(Option(method, tuple(m.stages[i] for i in p), w, ms, ar_ms / ms))
    options.sort(key=lambda o: o.ms_per_token)
    best = options[0] if options else None
    if best is not None and best.speedup >= 1 + margin:
        chosen, reason = best, f"predicted {best.speedup:.2f}x AR (>= 1 + margin {margin})"
    else:
        chosen = ar
        reason = (
            f"no speculative option is predicted to beat AR by the margin {margin} "
            f"(best: {best.method} {' -> '.join(best.pipeline)} at {best.speedup:.2f}x)"
            if best
            else "no speculative option to simulate (no drafter proposes along the calibration paths)"
        )
    return Plan(chosen, best, ar, margin, reason, tuple([ar, *options]), dict(m.threads))


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
        decode = replace(decode, lookahead=opt.window)
    method = plan.chosen.method if cfg.run.mode == "single" else cfg.method
    return replace(cfg, hierarchy=hier, decode=decode, method=method)


def table(plan: Plan, top: int = 8) -> str:
    lines = [f"{'method':<9} {'pipeline':<58} {'win':>3} {'ms/token':>9} {'vs AR':>7}"]
    for o in plan.options[: top + 1]:
        mark = " <- chosen" if o == plan.chosen else ""
        win = "-" if o.method == "ar" else str(o.window)
        path = " -> ".join(o.pipeline)
        lines.append(f"{o.method:<9} {path:<58} {win:>3} {o.ms_per_token:>9.2f} {o.speedup:>6.2f}x{mark}")
    lines.append(f"choice: {plan.reason}")
    return "\n".join(lines)
