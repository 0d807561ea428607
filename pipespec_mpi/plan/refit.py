"""What ``hierarchy=auto`` jobs on this node measured, as ratios that correct the next plan's
predictions.

The simulator predicts an option from its stages' timed costs and their agreement on a few
calibration prompts; what it leaves out (a suffix drafter learning from the job's own outputs,
the loop's overheads, neighbours' contention) shows as measured over predicted. After each auto
job, every option it measured (the chosen one, AR, each plan the online plan ran) updates its
ratio, kept per (method, pipeline, batch size) in the node's measurement cache; the next plan's
predictions are the simulator's times these (an option no job measured: the median ratio of its
method at its batch size). docs/auto.md, "What later jobs learn".
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pipespec_mpi.config import AppConfig, DecodeConfig
from pipespec_mpi.plan.options import Setting
from pipespec_mpi.plan.search import Source

KIND = "refit"
JOBS_KEPT = 4  # a ratio is the geometric mean over at most this many recent jobs (drift moves on)


@dataclass(frozen=True)
class Observation:
    """One option a job measured: its ms/token against the prediction it was planned with."""

    method: str
    pipeline: tuple[str, ...]  # stage names, the target last
    batch_size: int
    measured: float
    predicted: float


@dataclass(frozen=True)
class Ratio:
    method: str
    pipeline: tuple[str, ...]
    batch_size: int
    ratio: float  # measured over the simulator's prediction
    jobs: int  # how many jobs it is averaged over (at most JOBS_KEPT)


@dataclass(frozen=True)
class Refit:
    """The measured-over-predicted ratios of one node, stages, dataset and decode settings."""

    ratios: tuple[Ratio, ...] = ()

    def factor(self, method: str, pipeline: tuple[str, ...], batch_size: int) -> float:
        """What the simulator's prediction for this option is multiplied by."""
        same = [r for r in self.ratios if r.method == method and r.batch_size == batch_size]
        exact = [r.ratio for r in same if r.pipeline == tuple(pipeline)]
        if exact:
            return exact[0]
        return statistics.median(r.ratio for r in same) if same else 1.0

    def updated(self, seen: Iterable[Observation]) -> Refit:
        """With ``seen``, each predicted under this refit: a ratio's logarithm averaged with the
        jobs' before it (the newest JOBS_KEPT - 1 of them weighed as they were)."""
        by_key = {(r.method, r.pipeline, r.batch_size): r for r in self.ratios}
        for o in seen:
            if not (o.measured > 0 and o.predicted > 0):
                continue
            key = (o.method, tuple(o.pipeline), o.batch_size)
            new = o.measured / o.predicted * self.factor(*key)
            old = by_key.get(key)
            if old is None:
                by_key[key] = Ratio(*key, round(new, 4), 1)
                continue
            w = min(old.jobs, JOBS_KEPT - 1)
            mean = math.exp((w * math.log(old.ratio) + math.log(new)) / (w + 1))
            by_key[key] = Ratio(*key, round(mean, 4), min(old.jobs + 1, JOBS_KEPT))
        return Refit(tuple(sorted(by_key.values(), key=lambda r: (r.batch_size, r.method, r.pipeline))))

    def to_json(self) -> list[dict]:
        return [dataclasses.asdict(r) for r in self.ratios]

    @classmethod
    def from_json(cls, node: list | None) -> Refit:
        return cls(tuple(Ratio(**{**r, "pipeline": tuple(r["pipeline"])}) for r in node or ()))


@dataclass(frozen=True)
class RefitSource:
    """A ``Source`` whose predictions are another's times the refit's factor."""

    inner: Source
    refit: Refit

    @property
    def target(self) -> str:
        return self.inner.target

    @property
    def threads(self) -> Mapping[int, int]:
        return self.inner.threads

    def pipelines(self, max_stages: int) -> list[tuple[str, ...]]:
        return self.inner.pipelines(max_stages)

    def ms(self, pipeline: tuple[str, ...], setting: Setting, decode: DecodeConfig) -> float:
        f = self.refit.factor(setting.method, tuple(pipeline), setting.batch_size)
        return self.inner.ms(pipeline, setting, decode) * f


class RefitMemory:
    """The node's refit in the measurement cache (auto/fingerprint.py), under what the ratios
    depend on: the machine and how many ranks share it, the candidate stages, the dataset and
    the decode settings (the batch size aside: a ratio has its own)."""

    def __init__(self, cfg: AppConfig, cores: int, ranks_on_node: int) -> None:
        from pipespec_mpi.auto.fingerprint import MeasurementCache, cache_dir, machine, stage_identity

        self.cache = MeasurementCache(cache_dir(cfg.auto.cache_dir))
        d = cfg.dataset
        decode = {k: v for k, v in dataclasses.asdict(cfg.decode).items() if k != "batch_size"}
        self.parts = {
            "machine": machine(cores, ranks_on_node),
            "stages": stage_identity(cfg.hierarchy.stages),
            "dataset": {"name": d.name, "path": d.path, "hub_name": d.hub_name},
            "decode": decode,
        }

    def load(self) -> Refit:
        got = self.cache.get(KIND, self.parts)
        return Refit.from_json(got["ratios"]) if got else Refit()

    def save(self, refit: Refit) -> None:
        if refit.ratios:
            self.cache.put(KIND, self.parts, {"ratios": refit.to_json()})
