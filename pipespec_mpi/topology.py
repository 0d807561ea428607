"""Rank placement: world rank -> (pipeline replica, stage). Pure; no MPI import.

Ranks are laid out replica-major: replica r owns world ranks r*k .. r*k + k-1, stage s of replica r
is world rank r*k + s. With ``srun``/``mpirun`` filling nodes in order, each replica's stages sit
on consecutive ranks (the same node where they fit), which keeps proposal traffic node-local.

A route is a sub-pipeline of the hierarchy that a job may decode on instead of all of it (the
online plan, run/online.py): its stages in order, ending with the last; the replica's other
stages sit that job out. ``Placement.on_route`` is a rank's place on one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    # the stages a job decodes on (``routes``); None: all of them. Neighbours follow the route.
    route: tuple[int, ...] | None = None

    def on_route(self, route: tuple[int, ...]) -> Placement:
        """This rank's place when a job decodes on ``route`` (its neighbours are the route's)."""
        return replace(self, route=None if route == tuple(range(self.n_stages)) else tuple(route))

    @property
    def member(self) -> bool:
        """This rank's stage decodes on its route."""
        return self.route is None or self.stage in self.route

    def _along(self, step: int) -> int | None:
        """The hierarchy index of the stage ``step`` away along the route (None: past its end)."""
        stages = self.route if self.route is not None else tuple(range(self.n_stages))
        if self.stage not in stages:
            return None
        i = stages.index(self.stage) + step
        return stages[i] if 0 <= i < len(stages) else None

    @property
    def upstream_stage(self) -> int | None:
        """The stage that proposes to this one on its route."""
        return self._along(-1)

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
        up = self._along(-1)
        return None if up is None else self.rank_of(up)

    @property
    def downstream(self) -> int | None:
        """World rank of the stage that verifies this one's output (the larger model)."""
        down = self._along(1)
        return None if down is None else self.rank_of(down)

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


def routes(n_stages: int, model_free: frozenset[int] = frozenset()) -> list[tuple[int, ...]]:
    """Every route of a hierarchy of ``n_stages``: the sub-pipelines ending with its last stage in
    which a ``model_free`` stage (no model to verify with) comes first only; the whole hierarchy
    first, the last stage alone (AR) last, the longer before the shorter."""
    last = n_stages - 1
    found = []
    for mask in range(1 << last):
        stages = tuple(s for s in range(last) if mask >> s & 1) + (last,)
        if not any(s in model_free for s in stages[1:]):
            found.append(stages)
    return sorted(found, key=lambda r: (-len(r), r))


def route_name(route: tuple[int, ...]) -> str:
    """How a route is written in settings and records: its stage indices joined by '-'."""
    return "-".join(map(str, route))


def parse_route(text: str) -> tuple[int, ...]:
    """The route ``route_name`` wrote (ValueError if it is not one)."""
    return tuple(int(part) for part in str(text).split("-"))


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
