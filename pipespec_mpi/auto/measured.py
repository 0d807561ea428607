"""What ``hierarchy=auto`` measured, as data (cached as JSON): the candidate pipelines of a
hierarchy, the threads each rank gets, and along the target's greedy paths what every stage
proposed, read as agreement rates and lookup traces. The plan made from it: plan/sources.py
(``MeasuredSource``) and plan/search.py.

Notation (per candidate pipeline P = (s_0, ..., s_{k-1} = target) of the hierarchy's stages):
  cost_P[s](n)   measured seconds of stage s's forward over n new tokens while P's other stages
                 run beside it, each model rank with threads(m) threads (m: P's model stages;
                 a model-free drafter leaves its core share to them) on the CPUs the job binds
                 it to (``stage_shares``)
  a(x -> y)      agreement: over the positions of the target's greedy paths where x proposes,
                 the fraction where x's token equals y's (y = target: the path's own token)
  ms_P           the simulator's ms/token for P: the real stage loop replaying, prompt by
                 prompt, what each drafter proposed at each position of the target's path (a
                 lookup stage: its whole runs, ``run_trace``), i.i.d. a(s_j -> s_j+1) off the
                 path, each prompt's prefill included (a sizeable share of a short job's time:
                 leaving it out overstates every speedup; docs/notebook.md, "Measurements
                 behind the code's choices")
AR is the target alone with threads(1): ``ms_AR``. The plan is the fastest (method, P, window)
if ms_AR / ms >= 1 + margin, else AR: speculation must be predicted to pay by a margin.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipespec_mpi.auto.measure import Agreement, Pipeline, StageCost
from pipespec_mpi.config import DRAFTER_KINDS, StageConfig
from pipespec_mpi.host.placement import CpuShare, share_cpus

# Pipeline: stage indices of the candidate hierarchy, smallest first, target last


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


def stage_shares(
    k: int,
    replicas: int,
    cpus: Sequence[int],
    ranks_on_node: int,
    bound: bool,
    bind: bool = False,
    light: frozenset[int] = frozenset(),
) -> tuple[CpuShare, ...]:
    """The threads of the first replica's stages when k-stage pipelines run (``light``: the
    positions of model-free stages), and with ``bind`` (the phase binds: ``host/placement.py binds``)
    their CPUs, as the job gives them (``host/placement.py share_cpus``: the job's ranks fill nodes of
    ``ranks_on_node`` in rank order, every one seeing ``cpus``), or, when the launcher binds
    each rank to its own cores (``bound``), all of those."""
    if bound:
        return (CpuShare(len(cpus)),) * k
    hosts = [f"node{r // ranks_on_node}" for r in range(k * replicas)]
    seen = [frozenset(cpus)] * len(hosts)
    shares = (share_cpus(s, hosts, seen, k, light=light) for s in range(k))
    return tuple(sh if bind else CpuShare(sh.threads) for sh in shares)


def light_positions(model_free: frozenset[int], pipeline: Sequence[int]) -> frozenset[int]:
    """The positions in ``pipeline`` of its model-free stages (``HierarchyConfig.model_free``):
    they take no share of the cores."""
    return frozenset(j for j, i in enumerate(pipeline) if i in model_free)


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
    costs: Mapping[Pipeline, Sequence[StageCost]]  # P -> per stage of P
    threads: Mapping[int, int]  # model stages of a pipeline -> threads per model rank
    agreement: Agreement

    def to_json(self) -> dict:
        return {
            "stages": list(self.stages), "kinds": list(self.kinds), "max_proposal": list(self.max_proposal),
            "costs": [[list(p), [c.to_json() for c in cs]] for p, cs in self.costs.items()],
            "threads": {str(k): v for k, v in self.threads.items()},
            "agreement": self.agreement.to_json(),
        }  # fmt: skip

    @classmethod
    def from_json(cls, node: dict) -> Measured:
        return cls(
            stages=tuple(node["stages"]),
            kinds=tuple(node["kinds"]),
            max_proposal=tuple(node["max_proposal"]),
            costs={tuple(p): tuple(StageCost.from_json(c) for c in cs) for p, cs in node["costs"]},
            threads={int(k): v for k, v in node["threads"].items()},
            agreement=Agreement.from_json(node["agreement"]),
        )
