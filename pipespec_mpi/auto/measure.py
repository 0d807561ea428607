"""Run the measuring workers: each candidate pipeline's forward costs, each stage's proposals.

One worker process per candidate stage (worker.py), each loading its stage once. For a candidate
pipeline of k stages, its k workers are timed at once, each with the threads and CPUs a rank of
that pipeline gets (``run.cpu_bind``), the others running one-token forwards meanwhile: the node
is shared as the job will share it (a step is slower beside a busy neighbour, so a cost measured
alone would promise a speedup the job cannot have; docs/notebook.md, "Measurements behind the
code's choices"). Agreement is counted along the target's own greedy output of the calibration
prompts, the path every accepted token lies on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipespec_mpi.config import HierarchyConfig
from pipespec_mpi.host.placement import CpuShare


class MeasureError(RuntimeError):
    pass


@dataclass(frozen=True)
class Agreement:
    """Along the target's greedy path of each calibration prompt, what every stage proposes at
    each position with the path before it as context: a model its argmax, a lookup stage its
    whole continuation (empty where it finds none)."""

    paths: tuple[tuple[int, ...], ...]  # per prompt
    proposals: tuple[tuple[tuple[tuple[int, ...], ...], ...], ...]  # stage, prompt, position -> ids
    prompt_lens: tuple[int, ...] = ()  # per prompt (its prefill is part of a job's time)

    def first(self, stage: int, prompt: int) -> list[int]:
        """The first proposed token at each position (-1: none)."""
        return [run[0] if run else -1 for run in self.proposals[stage][prompt]]

    def tokens_of(self, stage: int, prompt: int) -> list[int]:
        """What ``stage`` would emit at each position: the path for the last, else its first token."""
        return list(self.paths[prompt]) if stage == len(self.proposals) - 1 else self.first(stage, prompt)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, node: dict) -> Agreement:
        tup = lambda x: tuple(tup(v) for v in x) if isinstance(x, list) else x  # noqa: E731
        return cls(tup(node["paths"]), tup(node["proposals"]), tup(node.get("prompt_lens", [])))


@dataclass(frozen=True)
class StageCost:
    """One stage's forward costs as timed inside one candidate pipeline (cached as JSON; a
    worker reports it as ``to_json`` writes it)."""

    points: tuple[tuple[int, float], ...]  # (new tokens in the forward, seconds), by tokens
    prefill_s: float = 0.0  # the prefill of ``context`` prompt tokens
    context: int = 0
    per_sequence_s: float = 0.0  # what one more sequence adds to a batched forward

    @property
    def one_token_s(self) -> float:
        return next(s for n, s in self.points if n == 1)

    def to_json(self) -> dict:
        return {"points": [list(p) for p in self.points], "prefill_s": self.prefill_s,
                "context": self.context, "per_sequence_s": self.per_sequence_s}  # fmt: skip

    @classmethod
    def from_json(cls, node: dict) -> StageCost:
        return cls(
            points=tuple((int(n), float(t)) for n, t in node["points"]),
            prefill_s=float(node.get("prefill_s", 0.0)),
            context=int(node.get("context", 0)),
            per_sequence_s=float(node.get("per_sequence_s", 0.0)),
        )


class Worker:
    """One measuring process (worker.py) and its line protocol; waits never spin (select)."""

    def __init__(self, hier: HierarchyConfig, stage: int, timeout_s: float) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPIR_", "HYDRA_"))}
        self.name, self.timeout_s = hier.stages[stage].name, timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipespec_mpi.auto.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.send({"hierarchy": dataclasses.asdict(hier), "stage": stage})

    def send(self, obj: dict | str) -> None:
        self.proc.stdin.write((obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            code = self.proc.poll()
            why = f"exited with {code}" if code is not None else f"no answer in {self.timeout_s:.0f} s"
            raise MeasureError(f"measuring stage {self.name!r}: the worker {why}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"do": "exit"})
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class Workers:
    """A worker per candidate stage, started together (their loads overlap), closed together."""

    def __init__(
        self, hier: HierarchyConfig, timeout_s: float = 300.0, stages: Sequence[int] | None = None
    ) -> None:
        """Workers for ``stages`` (default: every stage; a subset cannot measure agreement)."""
        self.hier = hier
        self.by_stage: dict[int, Worker] = {}
        try:
            for i in range(hier.n_stages) if stages is None else stages:
                self.by_stage[i] = Worker(hier, i, timeout_s)
            self.load_s = [w.reply()["ready"] for w in self.by_stage.values()]
        except BaseException:
            self.close()
            raise

    @property
    def all(self) -> list[Worker]:
        return list(self.by_stage.values())

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for w in self.all:
            w.close()

    def costs(
        self,
        pipeline: Sequence[int],
        shares: Sequence[CpuShare],
        context: Sequence[int],
        token_counts: Sequence[int],
        repeats: int,
    ) -> list[StageCost]:
        """Every stage of ``pipeline`` timed together, each with its rank's threads and CPUs."""
        ws = [self.by_stage[i] for i in pipeline]
        for w, share in zip(ws, shares, strict=True):
            w.send({"do": "cost", "threads": share.threads, "cpus": share.cpus, "context": list(context),
                    "token_counts": list(token_counts), "repeats": repeats})  # fmt: skip
        costs = [StageCost.from_json(w.reply()) for w in ws]  # each keeps the node busy until all are done
        for w in ws:
            w.send("stop")
        for w in ws:
            w.reply()
        return costs

    def agreement(
        self, prompts: Sequence[Sequence[int]], tokens: int, eos: int | None, threads: int
    ) -> Agreement:
        if len(self.by_stage) != self.hier.n_stages:
            raise ValueError("agreement needs a worker for every stage")
        target = self.all[-1]
        target.send({"do": "path", "threads": threads, "prompts": [list(p) for p in prompts],
                     "tokens": tokens, "eos": eos})  # fmt: skip
        paths = target.reply()["paths"]
        cmd = {"do": "propose", "threads": threads, "prompts": [list(p) for p in prompts], "paths": paths}
        proposals = []
        for w in self.all:  # one at a time: each gets the node
            w.send(cmd)
            proposals.append(w.reply()["proposals"])
        lens = [len(p) for p in prompts]
        return Agreement.from_json({"paths": paths, "proposals": proposals, "prompt_lens": lens})


Pipeline = tuple[int, ...]


@dataclass(frozen=True)
class CostCheck:
    """How the target's timings in the different pipelines compared (``disagreeing``)."""

    remeasured: tuple[Pipeline, ...] = ()  # timed again: their first timing disagreed
    still_off: tuple[Pipeline, ...] = ()  # disagreed again: kept, and said so in plan.json

    def to_json(self) -> dict:
        return {
            "remeasured": [list(p) for p in self.remeasured],
            "still_off": [list(p) for p in self.still_off],
        }


def disagreeing(
    costs: Mapping[Pipeline, Sequence[StageCost]], factor: float, model_free: frozenset[int] = frozenset()
) -> list[Pipeline]:
    """Pipelines whose timing of the target (their last stage) disagrees with its other timings.
    The target is timed in every pipeline. In pipelines with as many stages and as many busy
    neighbours (model stages: a ``model_free`` drafter, prompt lookup or suffix, leaves its core
    idle) its ranks get the same threads and the same contention, so its one-token step may
    differ by which neighbours they are but not by more than ``factor`` from the median of
    them; alone (AR) it has at least those threads and no neighbour, so it is not ``factor``
    slower than any such median. A timing that breaks either was disturbed (a busy process
    took the node for a while, as one that made a cached AR cost 12x too slow) and is timed
    again. (Grouped by length alone, int8 copy -> w8 copy -> SmolLM2 on 2 cores, two busy
    neighbours, was flagged against the pipelines led by an idle lookup stage.)"""
    groups: dict[tuple[int, int], list[Pipeline]] = {}
    for p in costs:
        groups.setdefault((len(p), sum(i not in model_free for i in p[:-1])), []).append(p)
    target = lambda p: costs[p][-1].one_token_s  # noqa: E731
    medians = {g: statistics.median(target(p) for p in ps) for g, ps in groups.items()}
    # a median of three or more (of two, each is as far from it as the other)
    off = [p for g, ps in groups.items() if len(ps) > 2 for p in ps
           if not within(target(p), medians[g], factor)]  # fmt: skip
    alone = next((p for p in costs if len(p) == 1), None)
    inside = [m for (k, _), m in medians.items() if k > 1]
    if alone is not None and inside and target(alone) > factor * min(inside):
        off.append(alone)
    return sorted(set(off), key=lambda p: (len(p), p))


def within(a: float, b: float, factor: float) -> bool:
    """``a`` and ``b`` no more than ``factor`` apart, either way."""
    return b / factor <= a <= b * factor


def measure_costs(
    workers: Workers,
    pipelines: Sequence[Sequence[int]],
    shares_of: Mapping[Pipeline, Sequence[CpuShare]],
    context: Sequence[int],
    token_counts: Sequence[int],
    repeats: int,
    factor: float = 1.5,
) -> tuple[dict[Pipeline, list[StageCost]], CostCheck]:
    """Costs of every stage of every candidate pipeline (each with its ranks' threads and CPUs),
    shortest pipelines first, and the pipelines whose timing of the target disagreed with the
    rest (``disagreeing``) timed once more. A drafter whose one-token step beside the target is
    at least the target's own can never run ahead of it: pipelines with more stages that
    contain it are not measured (a bf16 copy can be one: docs/notebook.md, "Measurements behind
    the code's choices")."""
    out: dict[Pipeline, list[StageCost]] = {}
    too_slow: set[int] = set()

    def timed(p: Pipeline) -> list[StageCost]:
        return workers.costs(p, shares_of[p], context, token_counts, repeats)

    for p in sorted((tuple(p) for p in pipelines), key=len):
        if len(p) > 2 and too_slow & set(p):
            continue
        out[p] = timed(p)
        if len(p) == 2 and out[p][0].one_token_s >= out[p][1].one_token_s:
            too_slow.add(p[0])
    model_free = workers.hier.model_free
    again = disagreeing(out, factor, model_free)
    for p in again:
        out[p] = timed(p)
    still = disagreeing(out, factor, model_free)
    return out, CostCheck(tuple(again), tuple(p for p in still if p in again))
