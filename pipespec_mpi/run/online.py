"""The online plan (``method=online``): which plan decodes the job's next prompt, learned from what
each plan measures on the job's own prompts. Pure: the runner asks ``OnlinePlan.pick`` on the
replica's leader, tells every stage, runs the prompt on it and reports ``observe``.

A plan (``Arm``) is a method on a route (topology.py ``routes``): AR is the last stage alone, a
speculative method runs on a sub-pipeline ending with it. The bandit: each plan decodes
``explore`` prompts first, in turn (drift hits all alike); then the plan whose median ms per token
over its newest ``window`` measurements is lowest runs, a challenger taking over only when it
measures ``margin`` faster (noise within it does not flap); a challenger is re-measured once
``recheck_every`` prompts have passed since its last run, times how many standard errors it is
measured behind the current plan beyond the margin (``_behind``: prompts differ, so one prompt's
measurement is noisy; a challenger that may still win runs again within a few prompts, one
clearly slower rarely), never beyond ``GIVE_UP``. Measurements remembered from an earlier job
count as one each (``prior``). Greedy outputs do not depend on the plan, so no timing here
changes what is output (docs/online.md).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipespec_mpi.config import AppConfig, OnlineConfig, SamplingConfig
from pipespec_mpi.run.jobs import job_methods
from pipespec_mpi.topology import parse_route, route_name, routes

# A challenger measured this many times slower than the current plan is not re-checked any more.
GIVE_UP = 2.0
# One prompt's measurement relative to its plan's: the spread assumed until a plan has 4
# measurements, and the least one used (a speculative plan's prompts differed by 15-25% on
# 2 cores, AR's by 5%, as their drafts' acceptance does: docs/notebook.md, "The online plan").
SPREAD_PRIOR = 0.15
MIN_SPREAD = 0.03


@dataclass(frozen=True)
class Arm:
    """A plan: ``method`` on ``route`` (the stages it decodes on; AR's: the last stage alone)."""

    method: str
    route: tuple[int, ...]

    @property
    def name(self) -> str:
        return "ar" if self.method == "ar" else f"{self.method} {route_name(self.route)}"


def arms(cfg: OnlineConfig, n_stages: int, model_free: frozenset[int]) -> list[Arm]:
    """The plans the online plan chooses among: ``cfg.methods`` on each of ``cfg.routes`` (if
    empty: every route of more than one stage that keeps the model-free stages, which cost next to
    nothing and whose proposals a verifier takes only where they pay), then AR."""
    last = n_stages - 1
    chosen = [parse_route(r) for r in cfg.routes] or [
        r for r in routes(n_stages, model_free) if model_free <= set(r)
    ]
    spec = [Arm(str(m), r) for r in chosen if len(r) > 1 for m in cfg.methods]
    return [*spec, Arm("ar", (last,))]


@dataclass(frozen=True)
class Pick:
    arm: Arm
    why: str


class OnlinePlan:
    """A bandit over ``arms`` by measured ms per token (module docstring). ``prior``: an earlier
    job's estimates by arm name (ms per token), each counted as one measurement."""

    def __init__(
        self, arms: Sequence[Arm], cfg: OnlineConfig, prior: Mapping[str, float] | None = None
    ) -> None:
        if not arms:
            raise ValueError("the online plan needs at least one plan")
        self.cfg = cfg
        known = dict(prior or {})
        # explored in the prior's order (fastest first), the rest in the given order
        self.arms = sorted(arms, key=lambda a: (a.name not in known, known.get(a.name, 0.0)))
        self.seen: dict[Arm, deque[float]] = {a: deque(maxlen=cfg.window) for a in self.arms}
        for a in self.arms:
            if a.name in known:
                self.seen[a].append(float(known[a.name]))
        self.remembered = {a.name for a in self.arms if a.name in known}
        self.current: Arm | None = None
        self.last_run: dict[Arm, int] = {a: -1 for a in self.arms}
        self.runs: dict[Arm, int] = {a: 0 for a in self.arms}
        self.tries = {a: int(a.name in known) for a in self.arms}  # runs, a remembered estimate as one
        self.switches: list[tuple[int, str, str]] = []  # (pick number, from, to)
        self.n = 0  # picks so far

    def estimate(self, arm: Arm) -> float | None:
        """Its median ms per token over the newest measurements (None: not measured)."""
        got = self.seen[arm]
        return statistics.median(got) if got else None

    def _cost(self, arm: Arm) -> float:
        e = self.estimate(arm)
        return float("inf") if e is None else e

    def pick(self) -> Pick:
        """The plan for the next prompt, and why."""
        self.n += 1
        fresh = [a for a in self.arms if self.tries[a] < self.cfg.explore]
        if fresh:
            done = len(self.arms) - len(fresh)
            arm = min(fresh, key=lambda a: self.tries[a])  # in turn: A B C A B C
            return self._run(Pick(arm, f"exploring: {done} of {len(self.arms)} plans measured"))
        best = min(self.arms, key=self._cost)
        cur = self.current
        if cur is None:
            self.current = best
            return self._run(Pick(best, f"fastest measured: {self._board()}"))
        if best != cur and self._cost(best) < self._cost(cur) * (1 - self.cfg.margin):
            self.switches.append((self.n, cur.name, best.name))
            self.current = cur = best
            return self._run(Pick(cur, f"switched: {self._board()}"))
        due = [(self._overdue(a, cur), a) for a in self.arms if a != cur]
        due = [(d, a) for d, a in due if d >= 1.0]
        if due:
            stale = max(due, key=lambda x: x[0])[1]
            return self._run(Pick(stale, f"re-checking against {cur.name}: {self._board()}"))
        return self._run(Pick(cur, f"current: {self._board()}"))

    def _overdue(self, arm: Arm, current: Arm) -> float:
        """How far past its re-check ``arm`` is (>= 1: due): the picks since it last ran over its
        interval, ``recheck_every`` times ``_behind`` (at least 2 picks: the current plan runs
        at least every other prompt); 0 beyond ``GIVE_UP``."""
        if self._cost(arm) > self._cost(current) * GIVE_UP:
            return 0.0
        interval = max(2.0, self.cfg.recheck_every * self._behind(arm, current))
        return (self.n - self.last_run[arm]) / interval

    def _behind(self, arm: Arm, current: Arm) -> float:
        """How many standard errors ``arm``'s estimate is behind the mark it must beat to take
        over (``current``'s less the margin), by each plan's relative spread (``spread``)."""
        cur, mine = self._cost(current), self._cost(arm)
        var = self.spread(arm) ** 2 / len(self.seen[arm]) + self.spread(current) ** 2 / len(
            self.seen[current]
        )
        return max(0.0, (mine - cur * (1 - self.cfg.margin)) / (cur * var**0.5))

    def spread(self, arm: Arm) -> float:
        """One prompt's measurement on ``arm`` relative to its estimate: the scaled median absolute
        deviation of its newest measurements (SPREAD_PRIOR until it has 4; at least MIN_SPREAD)."""
        got = self.seen[arm]
        if len(got) < 4:
            return SPREAD_PRIOR
        mid = statistics.median(got)
        return max(MIN_SPREAD, 1.4826 * statistics.median(abs(x / mid - 1) for x in got))

    def observe(self, arm: Arm, tokens: int, seconds: float) -> None:
        """What ``arm`` measured: ``tokens`` committed in ``seconds`` (nothing from an empty run)."""
        if tokens > 0:
            self.seen[arm].append(1000.0 * seconds / tokens)
            self.remembered.discard(arm.name)

    def estimates(self) -> dict[str, float]:
        """Every measured plan's estimate, by name (what a later job starts from)."""
        return {a.name: round(e, 4) for a in self.arms if (e := self.estimate(a)) is not None}

    def summary(self) -> dict[str, object]:
        """What the plan did: the plan it ended on, prompts per plan, the switches, the estimates."""
        return {
            "current": self.current.name if self.current is not None else None,
            "runs": {a.name: self.runs[a] for a in self.arms},
            "ms_per_token": self.estimates(),
            "switches": [{"pick": n, "from": f, "to": t} for n, f, t in self.switches],
            "remembered": sorted(self.remembered),
        }

    def _run(self, p: Pick) -> Pick:
        self.last_run[p.arm] = self.n
        self.runs[p.arm] += 1
        self.tries[p.arm] += 1
        return p

    def _board(self) -> str:
        measured = sorted((a for a in self.arms if self.seen[a]), key=self._cost)
        return ", ".join(f"{a.name} {self._cost(a):.2f}" for a in measured) + " ms/token"


def plans(cfg: AppConfig) -> list[Arm]:
    """The online plan's arms for this job's hierarchy."""
    h = cfg.hierarchy
    return arms(cfg.online, h.n_stages, h.model_free)


def extra_routes(cfg: AppConfig) -> list[tuple[int, ...]]:
    """The routes besides the whole hierarchy this job may decode on (each needs links of its own:
    run/setup.py ``connect``): the online plan's, where a job's method is online."""
    if "online" not in job_methods(cfg):
        return []
    whole = tuple(range(cfg.hierarchy.n_stages))
    found = [a.route for a in plans(cfg) if len(a.route) > 1 and a.route != whole]
    return list(dict.fromkeys(found))


def fixed(cfg: AppConfig, sampling: SamplingConfig) -> Arm | None:
    """The plan a prompt runs on whatever was measured, or None: a prompt sampled by Leviathan's
    rule outputs tokens that depend on the stages verifying them, so it always runs the whole
    hierarchy's PipeSpec (no timing may change what is output)."""
    n = cfg.hierarchy.n_stages
    if sampling.temperature > 0 and sampling.coupling == "leviathan" and n > 1:
        return Arm("pipespec", tuple(range(n)))
    return None
