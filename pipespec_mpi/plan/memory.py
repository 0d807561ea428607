"""The online plan's memory across jobs (run/decisions.py ``PlanMemory``): its estimates in the
node's measurement cache (auto/fingerprint.py), under what they depend on: the machine, the
stages, how many ranks share the node, the prompts' dataset, the decode settings and the batch
size. A later job with all of these the same starts from them and re-checks as it runs."""

from __future__ import annotations

import dataclasses
import os

from pipespec_mpi.auto.fingerprint import MeasurementCache, cache_dir, machine, stage_identity
from pipespec_mpi.comm.bootstrap import World
from pipespec_mpi.config import AppConfig

KIND = "online"


class NodeMemory:
    def __init__(self, cfg: AppConfig, world: World) -> None:
        self.cache = MeasurementCache(cache_dir(cfg.auto.cache_dir))
        on_node = sum(h == world.hosts[world.rank] for h in world.hosts)
        d = cfg.dataset
        self.parts = {
            "machine": machine(len(os.sched_getaffinity(0)), on_node),
            "stages": stage_identity(cfg.hierarchy.stages),
            "ranks": world.size,
            "dataset": {"name": d.name, "path": d.path, "hub_name": d.hub_name},
            "decode": dataclasses.asdict(cfg.decode),
            "online": {"routes": list(cfg.online.routes), "methods": list(cfg.online.methods)},
        }

    def load(self, batch_size: int) -> dict[str, float] | None:
        got = self.cache.get(KIND, {**self.parts, "batch_size": batch_size})
        return dict(got["ms_per_token"]) if got else None

    def save(self, batch_size: int, estimates: dict[str, float]) -> None:
        if estimates:
            self.cache.put(KIND, {**self.parts, "batch_size": batch_size}, {"ms_per_token": estimates})
