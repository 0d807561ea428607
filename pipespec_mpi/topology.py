"""Rank placement: world rank -> (pipeline replica, stage). Pure; no MPI import.

Ranks are laid out replica-major: replica r owns world ranks r*k .. r*k + k-1, stage s of replica r
is world rank r*k + s. With ``srun``/``mpirun`` filling nodes in order, each replica's stages sit
on consecutive ranks (the same node where they fit), which keeps proposal traffic node-local.
"""

from __future__ import annotations

from dataclasses import dataclass

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
