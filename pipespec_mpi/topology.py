"""Rank placement: world rank -> (pipeline replica, stage). Pure; no MPI import.

Ranks are laid out replica-major: replica r owns world ranks r*k .. r*k + k-1, stage s of replica r
is world rank r*k + s. With ``srun``/``mpirun`` filling nodes in order, each replica's stages sit
on consecutive ranks (the same node where they fit), which keeps proposal traffic node-local.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pipespec_mpi.errors import UserError


class TopologyError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class Placement:
    world_rank: int
    world_size: int
    n_stages: int
    replica: int
    stage: int

    @property
    def n_replicas(self) -> int:
        return self.world_size // self.n_stages

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1

    def rank_of(self, stage: int) -> int:
        """World rank of ``stage`` in this rank's replica."""
        if not 0 <= stage < self.n_stages:
            raise IndexError(f"stage {stage} outside 0..{self.n_stages - 1}")
        return self.replica * self.n_stages + stage

    @property
    def upstream(self) -> int | None:
        """World rank of the stage that proposes to this one (the smaller model)."""
        return None if self.is_first else self.rank_of(self.stage - 1)

    @property
    def downstream(self) -> int | None:
        """World rank of the stage that verifies this one's output (the larger model)."""
        return None if self.is_last else self.rank_of(self.stage + 1)

    @property
    def neighbours(self) -> list[int]:
        """World ranks of the stages next to this one (upstream first): what reads its header."""
        return [r for r in (self.upstream, self.downstream) if r is not None]

    @property
    def peers(self) -> list[int]:
        """World ranks of the replica's other stages: the members of its jobs' deal, start gate
        and handoff (the neighbours among them)."""
        return [r for r in self.replica_ranks() if r != self.world_rank]

    @property
    def leader(self) -> int:
        """The replica's last stage: it holds the answer and writes the replica's results."""
        return self.rank_of(self.n_stages - 1)

    def replica_ranks(self) -> list[int]:
        return [self.rank_of(s) for s in range(self.n_stages)]


def check_world(world_size: int, n_stages: int) -> None:
    """Raise one clear error when the world cannot be cut into whole pipelines."""
    if n_stages < 1:
        raise TopologyError(f"the hierarchy has {n_stages} stages; at least 1 is needed")
    if world_size < n_stages or world_size % n_stages:
        raise TopologyError(
            f"world size {world_size} is not a multiple of the hierarchy's {n_stages} stages: "
            f"launch with mpirun -n {n_stages} (one pipeline) or -n {2 * n_stages} "
            f"(two replicas), ... ({world_size} % {n_stages} = {world_size % n_stages})"
        )


def place(world_rank: int, world_size: int, n_stages: int) -> Placement:
    check_world(world_size, n_stages)
    if not 0 <= world_rank < world_size:
        raise TopologyError(f"rank {world_rank} outside 0..{world_size - 1}")
    return Placement(
        world_rank=world_rank,
        world_size=world_size,
        n_stages=n_stages,
        replica=world_rank // n_stages,
        stage=world_rank % n_stages,
    )


def device_for(stage_gpus: list[int], stage: int, local_rank: int, n_local_gpus: int) -> list[int]:
    """CUDA device indices owned by ``stage`` on its node.

    ``stage_gpus[s]`` is how many GPUs stage s spans. Within a node, stages take consecutive
    devices in stage order, so a replica of 1B/8B/70B(2 GPUs) uses devices 0, 1, 2-3. When the
    node has fewer GPUs than the replica needs (e.g. three ranks sharing one GPU for a smoke
    test), devices are shared round-robin.
    """
    if n_local_gpus <= 0:
        return []
    local_replica = local_rank // len(stage_gpus)  # replicas packed node by node, in rank order
    first = local_replica * sum(stage_gpus) + sum(stage_gpus[:stage])
    return [(first + j) % n_local_gpus for j in range(stage_gpus[stage])]


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
    drafter, busy about 1-2% of a core) one thread, every model stage ``len(cpus) // model
    ranks``; so suffix -> SmolLM2 on 2 cores runs the target on both (its step 18.7 -> 11.8 ms,
    AR 44.7 -> 63.7 tokens/s and PipeSpec 63.9 -> 83.2 on held-out code; 2-core Xeon with AMX,
    2026-12-05), where an even split left one core to the drafter. Where the ranks outnumber the
    CPUs, each pipeline's last stage gets a CPU of its own (the last ones) and the other ranks
    share the rest, in the phases that bind (``binds``). Needs a CPU left over for the others:
    with as many last stages as CPUs or more, nobody binds. ``threads`` (the stage's own
    setting) overrides the count, never the CPUs (nor the ``cores`` it accounts for).

    A last stage computes alone in AR, so there it takes the CPUs its node's other stages leave
    idle (``solo``; at least ``threads``, which sets how the stages of a pipeline share the node:
    ``hierarchy=auto`` sets it on every stage it runs), unbound: AR is the target alone on the
    node's cores, as ``hierarchy=auto`` prices it. On 2 cores the three-stage default's AR ran
    one thread beside an idle middle stage (77.5 tokens/s against 114.4 on both cores, held-out
    code, 2-core Xeon with AMX, 2026-12-05), which flattered every speed-up over it."""
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
    is the bottleneck, and the other ranks' drafting, polling and adopting for every slot took
    about a third of its core: on a 2-core EPYC (three ranks, code and prose, 2026-12-03) bound
    it ran batch-16 PipeSpec at 0.86-1.21x batched AR against 0.76-0.91x free (3 of 4 alternated
    pairs ahead), batch 4 at 0.95-1.25x against 0.94-1.12x (2 of 4). At batch 1 the middle stage
    is the bottleneck, and free it borrows the target's core while the target waits: bound,
    1.32-1.62x AR against 1.42-1.71x free (3 of 3 pairs behind)."""
    return mode == "always" or (mode == "auto" and batch_size > 1)
