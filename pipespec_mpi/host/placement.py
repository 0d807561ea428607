"""Each rank's threads and CPUs on its node (the CPU host's; platforms.py says where it applies).

``share_cpus`` (pure) splits a node's CPUs among its ranks from every rank's host and affinity;
``CpuPlacement`` applies a rank's share job by job (its threads, and its CPU binding in the phases
``run.cpu_bind`` binds); run/setup.py ``place_cpus`` gathers the affinities and builds it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class CpuShare:
    """A rank's torch threads, and the CPUs it binds itself to where a phase runs bound (None:
    it never binds; it keeps the CPUs it was launched with)."""

    threads: int
    cpus: tuple[int, ...] | None = None
    # A last stage's threads where it computes alone (AR: the other stages of its pipeline idle),
    # where these differ from ``threads``: the CPUs its pipeline's other model stages leave idle.
    solo: int | None = None
    # The node's CPUs this rank accounts for in a cost (``core_hours_per_million_tokens``): the
    # ranks of a node together account for all of its CPUs, a model-free stage beside model
    # stages for none (it borrows a thread of theirs). Not where it computes: equality ignores it.
    cores: float | None = field(default=None, compare=False)


def share_cpus(
    rank: int,
    hosts: Sequence[str],
    affinities: Sequence[frozenset[int]],
    n_stages: int,
    threads: int | None = None,
    light: frozenset[int] = frozenset(),
) -> CpuShare:
    """Where ``rank`` computes, from every rank's host and CPU affinity (rank order).

    A launcher that gave the ranks of a node different CPUs (``srun --cpus-per-task``, ``mpirun
    --bind-to core``) decided: a rank uses all of its own. Ranks that all see the same CPUs split
    them, left to the OS scheduler: a ``light`` stage (its index in the pipeline: a model-free
    drafter, busy a small share of a core) one thread, every model stage ``len(cpus) // model
    ranks``; so suffix -> SmolLM2 on 2 cores runs the target on both, where an even split left one
    core to the drafter (docs/notebook.md, "Measurements behind the code's choices"). Where the
    ranks outnumber the CPUs, each pipeline's last stage gets a CPU of its own (the last ones) and
    the other ranks share the rest, in the phases that bind (``binds``). Needs a CPU left over for
    the others: with as many last stages as CPUs or more, nobody binds. ``threads`` (the stage's
    own setting) overrides the count, never the CPUs (nor the ``cores`` it accounts for).

    A last stage computes alone in AR, so there it takes the CPUs its node's other stages leave
    idle (``solo``; at least ``threads``, which sets how the stages of a pipeline share the node:
    ``hierarchy=auto`` sets it on every stage it runs), unbound: AR is the target alone on the
    node's cores, as ``hierarchy=auto`` prices it. On 2 cores the three-stage default's AR ran
    one thread beside an idle middle stage, which flattered every speed-up over it
    (docs/notebook.md, "Measurements behind the code's choices")."""
    mine = affinities[rank]
    node = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    if any(affinities[r] != mine for r in node):
        return CpuShare(threads or len(mine), cores=len(mine))
    cpus = sorted(mine)
    lasts = [r for r in node if r % n_stages == n_stages - 1]
    alone = max(threads or 1, len(cpus) // len(lasts)) if rank in lasts else None
    if len(node) <= len(cpus) or len(cpus) <= len(lasts):
        models = sum(r % n_stages not in light for r in node)
        if rank % n_stages in light:
            return CpuShare(threads or 1, cores=0.0 if models else len(cpus) / len(node))
        n = threads or max(1, len(cpus) // models)
        return CpuShare(n, solo=_differs(alone, n), cores=len(cpus) / models)
    rest = cpus[: len(cpus) - len(lasts)]
    if rank in lasts:
        n = threads or 1
        return CpuShare(n, (cpus[len(rest) + lasts.index(rank)],), solo=_differs(alone, n), cores=1.0)
    others = len(node) - len(lasts)
    return CpuShare(threads or max(1, len(rest) // others), tuple(rest), cores=len(rest) / others)


def _differs(alone: int | None, threads: int) -> int | None:
    return None if alone == threads else alone


def binds(mode: str, batch_size: int) -> bool:
    """Whether a phase at ``batch_size`` runs on the bound CPUs of ``share_cpus`` (``run.cpu_bind``).

    ``auto`` binds the batched phases only. There the last stage computes every slot's rows and
    is the bottleneck, and the other ranks' drafting, polling and adopting for every slot take a
    share of its core that binding gives back. At batch 1 the middle stage is the bottleneck, and
    free it borrows the target's core while the target waits, so binding there slows it
    (docs/notebook.md, "Measurements behind the code's choices")."""
    return mode == "always" or (mode == "auto" and batch_size > 1)


class CpuPlacement:
    """This rank's torch threads and CPUs, job by job: ``share.cpus`` in the phases ``run.cpu_bind``
    binds (``host/placement.py binds``), else the CPUs it was launched with; a last stage computing alone
    (AR) takes ``share.solo`` threads, unbound."""

    def __init__(
        self, share: CpuShare, mode: str, routes: dict[tuple[int, ...], CpuShare] | None = None
    ) -> None:
        import torch

        self.share, self.mode = share, mode
        # where a job decodes on a route (run/online.py), this rank's share among its stages
        self.routes = dict(routes or {})
        self.home = self.current = frozenset(os.sched_getaffinity(0))
        self.threads = share.threads  # its torch threads now
        torch.set_num_threads(self.threads)

    @property
    def cores(self) -> float | None:
        return self.share.cores

    @property
    def where(self) -> str:
        """Where it computes, for the log."""
        bound_at = {b: binds(self.mode, b) for b in (1, 2)}
        alone = "" if self.share.solo is None else f"; {self.share.solo} threads, unbound, in AR"
        if self.share.cpus is None or not any(bound_at.values()):
            return "its launched CPUs" + alone
        cpus = "CPUs " + ",".join(map(str, self.share.cpus))
        where = cpus if all(bound_at.values()) else f"{cpus} in batched phases (its launched CPUs at batch 1)"
        return where + alone

    @property
    def bound(self) -> list[int] | None:
        """The CPUs it is bound to now (None: those it was launched with)."""
        return None if self.current == self.home else sorted(self.current)

    def as_alone(self) -> None:
        """Compute in every method as the last stage computes alone (AR): ``share.solo`` threads,
        unbound. For a stage whose logits may change with the thread count (not on the CPU
        kernels: models/scorer.py ``thread_invariant``), so that no method's output differs from
        the reference's by its threads."""
        import torch

        self.share = CpuShare(self.share.solo, None, cores=self.share.cores)
        self.routes = {}
        self.threads = self.share.threads
        torch.set_num_threads(self.threads)

    def one_count(self) -> None:
        """One torch thread count on every route: the routes' own shares given up (for a compiled
        forward, which would be compiled again for each count it meets)."""
        self.routes = {}

    def enter(self, batch_size: int, method: str, route: tuple[int, ...] | None = None) -> None:
        """Threads and CPUs for a job of ``method`` at ``batch_size`` on ``route`` (None: the
        whole hierarchy; idempotent: the jobs of a phase ask alike; at batch 1 the methods
        alternate job by job)."""
        import torch

        alone = method == "ar" and self.share.solo is not None
        share = self.routes.get(route, self.share) if route is not None else self.share
        bound = share.cpus is not None and binds(self.mode, batch_size) and not alone
        want = frozenset(share.cpus) if bound else self.home
        if want != self.current:
            os.sched_setaffinity(0, want)
            self.current = want
        threads = self.share.solo if alone else share.threads
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
