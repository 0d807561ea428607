"""Measure (or read from the cache, checked): what ``hierarchy=auto`` and ``plan --measure`` plan
from. "Calibrate" means this only: measuring this node.

No MPI here: the job's rank 0 calls ``calibrate``, plans (plan/job.py) and broadcasts the plan.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pipespec_mpi.auto import fingerprint
from pipespec_mpi.auto.measure import Agreement, CostCheck, StageCost, Workers, measure_costs, within
from pipespec_mpi.auto.measured import Measured, agreement_rate, candidates, light_positions, stage_shares
from pipespec_mpi.config import AppConfig, ConfigError, HierarchyConfig
from pipespec_mpi.host.placement import CpuShare, binds

log = logging.getLogger("pipespec_mpi")


@dataclass(frozen=True)
class Node:
    """Where the job's ranks run, as the measurement must reproduce it."""

    cpus: tuple[int, ...]  # the CPUs a rank sees (its affinity)
    ranks_on_node: int  # the job's ranks on this node
    ranks_per_replica: int  # most stages a pipeline may have (world size / auto.replicas)
    bound: bool  # the launcher gave each rank its own cores (srun --cpus-per-task)

    @classmethod
    def here(cls, replicas: int, world_size: int, ranks_on_node: int, bound: bool | None = None) -> Node:
        """This process's node for a job of ``world_size`` ranks, ``ranks_on_node`` of them here;
        ``bound`` unset: judged from this process's CPU affinity."""
        if world_size < 1 or world_size % replicas:
            raise ConfigError([f"auto.replicas={replicas} does not divide the world size {world_size}"])
        cpus = tuple(sorted(os.sched_getaffinity(0)))
        if bound is None:
            bound = len(cpus) < (os.cpu_count() or len(cpus))  # the launcher gave this rank its own cores
        return cls(cpus, ranks_on_node, world_size // replicas, bound)

    @property
    def cores(self) -> int:
        return len(self.cpus)


@dataclass(frozen=True)
class SpotCheck:
    """The target's one-token step, timed now, against the cost the cache holds for it: costs
    measured beside another process, many times the target's own, would otherwise plan every
    later job on the node (docs/notebook.md, "Measurements behind the code's choices")."""

    cached_s: float
    measured_s: float
    factor: float  # auto.stale_factor

    @property
    def agrees(self) -> bool:
        return within(self.measured_s, self.cached_s, self.factor)

    def to_json(self) -> dict:
        return {
            "cached_ms": round(1000 * self.cached_s, 3),
            "measured_ms": round(1000 * self.measured_s, 3),
            "factor": self.factor,
            "verdict": "agrees" if self.agrees else "stale: measured again",
        }


def spot_check(
    hier: HierarchyConfig, costs: dict, share: CpuShare, context: Sequence[int], repeats: int, factor: float
) -> SpotCheck | None:
    """Time the target's one-token step alone (one worker with ``share``'s threads and CPUs, as
    the cached AR cost was timed) and compare; None where the cache holds no such cost."""
    last = hier.n_stages - 1
    cached = next((c for p, c in costs["costs"] if tuple(p) == (last,)), None)
    if cached is None:
        return None
    with Workers(hier, stages=(last,)) as w:
        now = w.costs((last,), (share,), context, (1,), max(3, repeats))
    return SpotCheck(StageCost.from_json(cached[0]).one_token_s, now[0].one_token_s, factor)


@dataclass(frozen=True)
class Calibration:
    measured: Measured
    max_stages: int  # stages a plan may use here (auto.max_stages, and the ranks of a replica)
    seconds: float
    cached: tuple[str, ...]  # which measurements came from the cache: costs, agreement
    cache_files: dict[str, str]  # kind (costs, agreement) -> its cache file
    not_measured: tuple[tuple[str, ...], ...] = ()  # pipelines with a drafter slower than the target
    phases: dict[str, float] | None = None  # seconds: starting the workers, agreement, costs
    spot: SpotCheck | None = None  # the cached costs' check at start (None: measured now)
    check: CostCheck | None = None  # the target's timings across pipelines (None: from the cache)


def calibration_prompts(cfg: AppConfig, tokenizer) -> list[list[int]]:
    """Token ids of the prompts to calibrate on: the job's own first ones, or those of
    ``auto.calibration_path`` (read as ``dataset=files``, tokenized as the job's)."""
    from pipespec_mpi.data.datasets import DatasetError
    from pipespec_mpi.run.jobs import tokenize_prompts

    a, ds = cfg.auto, cfg.dataset
    if a.calibration_path:
        if not Path(a.calibration_path).is_file():
            raise DatasetError(f"auto.calibration_path={a.calibration_path!r}: no such file")
        given = replace(
            ds, name="files", path=a.calibration_path, n_prompts=a.calibration_prompts, shuffle=False
        )
        try:
            items = tokenize_prompts(replace(cfg, dataset=given), tokenizer).prompts
        except DatasetError as err:
            raise DatasetError(f"auto.calibration_path: {err}") from err
    else:
        items = tokenize_prompts(cfg, tokenizer).prompts
    if not items:
        raise DatasetError("no prompts to calibrate on")
    return [p.ids for p in items[: a.calibration_prompts]]


def _prompt_digest(prompts: Sequence[Sequence[int]]) -> str:
    return hashlib.sha256(repr([list(p) for p in prompts]).encode()).hexdigest()[:16]


def calibrate(cfg: AppConfig, prompts: Sequence[Sequence[int]], eos: int | None, node: Node) -> Calibration:
    """Costs of every candidate pipeline and agreement along the target's greedy output of the
    calibration prompts (each from the cache when it holds them for this machine and prompt
    set, unless ``auto.force``), then the simulator's choice."""
    t0 = time.perf_counter()
    a, hier = cfg.auto, cfg.hierarchy
    max_k = min(a.max_stages, node.ranks_per_replica)
    pipelines = candidates(hier.stages, max_k)
    bind = binds(cfg.run.cpu_bind, 1)  # the costs are of batch-1 forwards
    light = {p: light_positions(hier.model_free, p) for p in pipelines}
    shares = {
        p: stage_shares(len(p), a.replicas, node.cpus, node.ranks_on_node, node.bound, bind, light[p])
        for p in pipelines
    }
    threads: dict[int, int] = {}  # a model rank's threads, by the pipeline's model stages
    for p, sh in shares.items():
        threads.setdefault(len(p) - len(light[p]), sh[-1].threads)
    alone = (hier.n_stages - 1,)  # AR: the target alone
    calib = [list(p) for p in prompts[: a.calibration_prompts]]
    stages = fingerprint.stage_identity(hier.stages)
    cost_for = {
        "format": 4,  # prefill timed too; what a sequence adds to a batched forward; model-free shares
        "machine": fingerprint.machine(node.cores, node.ranks_on_node),
        "stages": stages,
        "threads": threads,
        "cpus": {"+".join(map(str, p)): [sh.cpus for sh in v] for p, v in shares.items()},  # where bound
        "pipelines": [list(p) for p in pipelines],
        "token_counts": list(a.token_counts),
        "repeats": a.repeats,
    }  # not the prompts: a cost hardly depends on which (the context length is kept beside it)
    agree_for = {
        "format": 3,  # whole lookup continuations, prompt lengths
        "stages": stages,
        "prompts": _prompt_digest(calib),
        "tokens": a.calibration_tokens,
        "eos": eos,
    }
    cache = fingerprint.MeasurementCache(fingerprint.cache_dir(a.cache_dir))
    costs = None if a.force else cache.get("costs", cost_for)
    agree = None if a.force else cache.get("agreement", agree_for)
    phases: dict[str, float] = {}
    spot = check = None
    if costs is not None:
        t = time.perf_counter()
        spot = spot_check(hier, costs, shares[alone][0], calib[0], a.repeats, a.stale_factor)
        phases["spot_check_s"] = time.perf_counter() - t
        if spot is not None and not spot.agrees:
            log.warning(
                "auto: the cached costs are stale: the target's one-token step took %.2f ms now and "
                "%.2f ms when cached (more than %gx apart); measuring again",
                1000 * spot.measured_s, 1000 * spot.cached_s, spot.factor,
            )  # fmt: skip
            costs = None
    cached = tuple(k for k, v in (("costs", costs), ("agreement", agree)) if v is not None)
    if costs is None or agree is None:
        log.info("auto: measuring %d stages, %d pipelines on this machine", hier.n_stages, len(pipelines))
        t = time.perf_counter()
        with Workers(hier) as workers:
            phases["start_s"] = time.perf_counter() - t
            if agree is None:
                t = time.perf_counter()
                ag = workers.agreement(calib, a.calibration_tokens, eos, shares[alone][0].threads)
                agree = ag.to_json()
                cache.put("agreement", agree_for, agree)
                phases["agreement_s"] = time.perf_counter() - t
            if costs is None:
                t = time.perf_counter()
                got, check = measure_costs(
                    workers, pipelines, shares, calib[0], a.token_counts, a.repeats, a.stale_factor
                )
                if check.remeasured:
                    log.warning(
                        "auto: the target's step disagreed across pipelines %s: timed them again (%s)",
                        check.remeasured,
                        f"still off: {check.still_off}; this job plans with them, but they are not "
                        "cached" if check.still_off else "agree now",
                    )  # fmt: skip
                costs = {"costs": [[list(p), [c.to_json() for c in cs]] for p, cs in got.items()]}
                # Timings that still disagree mean the node was disturbed throughout (docs/notebook.md,
                # "Measurements behind the code's choices"): never cached, so the next job measures
                # again.
                if not check.still_off:
                    cache.put("costs", cost_for, costs)
                phases["costs_s"] = time.perf_counter() - t
    costs = costs["costs"]
    measured = Measured(
        stages=tuple(s.name for s in hier.stages),
        kinds=tuple(s.kind for s in hier.stages),
        max_proposal=tuple(s.max_proposal for s in hier.stages),
        costs={tuple(p): tuple(StageCost.from_json(c) for c in cs) for p, cs in costs},
        threads=threads,
        agreement=Agreement.from_json(agree),
    )
    files = {
        "costs": str(cache.path("costs", cost_for)),
        "agreement": str(cache.path("agreement", agree_for)),
    }
    names = measured.stages
    skipped = tuple(tuple(names[i] for i in p) for p in pipelines if p not in measured.costs)
    return Calibration(measured, max_k, time.perf_counter() - t0, cached, files, skipped, phases, spot, check)


@dataclass(frozen=True)
class CalibrationSummary:
    """How the measurements were had (auto/calibrate.py ``summary``)."""

    calibration_s: float
    calibration_phases_s: dict[str, float]
    from_cache: list[str]  # costs, agreement: which came from the cache
    cache_files: dict[str, str]
    spot_check: dict | None  # SpotCheck.to_json: the cached target step against one timed now
    not_measured: list[str]  # pipelines with a drafter slower than the target
    stages: list[str]
    rates: dict[str, float]  # "a -> b": agreement
    cost_check: dict | None = None  # CostCheck.to_json: timings of the target timed again


def summary(cal: Calibration) -> CalibrationSummary:
    """The measurements as the run's plan.json keeps them."""
    return CalibrationSummary(
        calibration_s=round(cal.seconds, 2),
        calibration_phases_s={k: round(v, 2) for k, v in (cal.phases or {}).items()},
        from_cache=list(cal.cached),
        cache_files=dict(cal.cache_files),
        spot_check=cal.spot.to_json() if cal.spot else None,
        not_measured=[" -> ".join(p) for p in cal.not_measured],
        stages=list(cal.measured.stages),
        rates={f"{a} -> {b}": r for a, b, r in _pair_rates(cal.measured)},
        cost_check=cal.check.to_json() if cal.check else None,
    )


def _pair_rates(m: Measured):
    n = len(m.stages)
    for i in range(n - 1):
        for j in range(i + 1, n):
            r = agreement_rate(m.agreement, i, j)
            if r is not None:
                yield m.stages[i], m.stages[j], round(r, 4)
