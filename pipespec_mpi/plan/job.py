"""``hierarchy=auto`` in an MPI job: rank 0 measures and chooses, every rank learns the plan, the
ranks the plan uses run it, the others wait for the job's end without using a core.

The job is launched for the candidate hierarchy (``mpirun -n 3`` for three candidate stages in
``auto.replicas=1`` pipeline); a plan of k stages uses ranks 0 .. k*replicas-1 (replica r: ranks
r*k .. r*k+k-1), so rank 0, which writes the run's files, always runs. The rest are spare: they
hold no model and sleep until the job ends.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from pipespec_mpi.auto.calibrate import Calibration, Node, calibrate, calibration_prompts, summary
from pipespec_mpi.auto.measure import within
from pipespec_mpi.comm.bootstrap import World, mpi, sub_world
from pipespec_mpi.config import AppConfig
from pipespec_mpi.errors import UserError
from pipespec_mpi.host.wait import sleep_at_barrier
from pipespec_mpi.plan.options import AUTO_GRID, Plan
from pipespec_mpi.plan.realize import online_pipeline, realize
from pipespec_mpi.plan.record import Machine, PlanRecord, RunsAs, SearchInputs, read_plan, write_plan
from pipespec_mpi.plan.refit import Observation, Refit, RefitMemory, RefitSource
from pipespec_mpi.plan.search import search
from pipespec_mpi.plan.sources import MeasuredSource
from pipespec_mpi.plan.table import table
from pipespec_mpi.records import SUMMARY, find_entry, group_key, read_summary
from pipespec_mpi.run.decisions import ONLINE
from pipespec_mpi.topology import parse_route

log = logging.getLogger("pipespec_mpi")


@dataclass(frozen=True)
class AutoJob:
    cfg: AppConfig  # the plan's config (its stages, method, window)
    world: World | None  # the ranks that run it; None on a spare rank
    record: PlanRecord  # what plan.json holds


def plan_of(inputs: SearchInputs) -> Plan:
    """The plan from measurements: the one search, on the grid ``hierarchy=auto`` searches."""
    grid = replace(AUTO_GRID, batch_sizes=inputs.batch_sizes)
    source = MeasuredSource(inputs.measured)
    if inputs.refit.ratios:
        source = RefitSource(source, inputs.refit)
    return search(source, inputs.decode, grid, inputs.max_stages, inputs.margin)


def search_inputs(cfg: AppConfig, cal: Calibration, refit: Refit) -> SearchInputs:
    a = cfg.auto
    return SearchInputs(cal.measured, cfg.decode, cal.max_stages, a.margin, tuple(a.batch_sizes), refit)


def choose(cfg: AppConfig, cal: Calibration, node: Node) -> Plan:
    """The plan from this node's measurements, corrected by what earlier jobs here measured
    (plan/refit.py): what ``hierarchy=auto`` runs and ``pipespec-plan --measure`` prints (the
    same call, so the same choice)."""
    return plan_of(search_inputs(cfg, cal, refit_of(cfg, node)))


def refit_of(cfg: AppConfig, node: Node) -> Refit:
    return RefitMemory(cfg, node.cores, node.ranks_on_node).load()


def replan(run_dir: Path) -> Plan | None:
    """The plan again from what a ``hierarchy=auto`` run planned from (its plan.json), or None
    when the run is not one."""
    record = read_plan(run_dir)
    return plan_of(record.inputs) if record is not None and record.inputs is not None else None


def choose_on_rank0(cfg: AppConfig, world: World) -> tuple[AppConfig, PlanRecord]:
    from pipespec_mpi.models.loader import load_tokenizer

    node = Node.here(cfg.auto.replicas, world.size, world.local_size)
    tok = load_tokenizer(cfg.hierarchy.tokenizer, cfg.hierarchy.name)
    prompts = calibration_prompts(cfg, tok)
    cal: Calibration = calibrate(cfg, prompts, tok.eos_token_id, node)
    inputs = search_inputs(cfg, cal, refit_of(cfg, node))
    plan = plan_of(inputs)
    chosen = realize(cfg, plan, node.bound)
    refit = inputs.refit.ratios
    log.info(
        "auto: %s in %.1f s%s%s%s\n%s",
        "planned" if cal.cached else "measured and planned",
        cal.seconds,
        f" (from the cache: {', '.join(cal.cached)})" if cal.cached else "",
        f"; spot check of the cached costs: {cal.spot.to_json()}" if cal.spot else "",
        f"; predictions times what {max(r.jobs for r in refit)} earlier job(s) here measured against "
        f"theirs ({len(refit)} options)"
        if refit
        else "",
        table(plan),
    )
    record = PlanRecord(
        plan=plan, calibration=summary(cal), candidates=cfg.hierarchy.name,
        runs=RunsAs(chosen.hierarchy.name, chosen.method, chosen.decode.lookahead, chosen.decode.sd_window,
                    chosen.decode.max_run_ahead,
                    tuple(chosen.run.methods) if chosen.run.mode == "benchmark" else (chosen.method,)),
        machine=Machine(node.cores, node.ranks_on_node, node.bound),
        inputs=inputs,
    )  # fmt: skip
    return chosen, record


def resolve(cfg: AppConfig, world: World) -> AutoJob:
    """Every rank: the plan (rank 0 computes it; an error there is raised on every rank) and,
    for the ranks it uses, their own communicator."""
    comm = world.comm
    chosen = record = err = None
    if world.rank == 0:
        try:
            chosen, record = choose_on_rank0(cfg, world)
        except UserError as e:
            err = e
    sleep_at_barrier(comm)  # the others sleep meanwhile: MPICH's bcast would spin their cores
    chosen, record, err = comm.bcast((chosen, record, err), root=0)
    if err is not None:
        err.collective = True
        raise err
    active = chosen.hierarchy.n_stages * chosen.auto.replicas
    MPI = mpi()
    sub = comm.Split(color=0 if world.rank < active else MPI.UNDEFINED, key=world.rank)
    if sub == MPI.COMM_NULL:
        log.warning("rank %d is spare: the plan uses ranks 0..%d", world.rank, active - 1)
        return AutoJob(chosen, None, record)
    return AutoJob(chosen, sub_world(sub), record)


def add_measured(
    run_dir: Path, record: PlanRecord, off_factor: float, memory: RefitMemory | None = None
) -> PlanRecord:
    """After the run (rank 0): the measured ms/token beside the prediction, written to plan.json.
    Every prediction the run measured is checked: the chosen option's, and AR's where the run
    decoded AR too (benchmark mode). One further than ``off_factor`` (auto.off_factor) either
    way says so, in plan.json and the log, and drops the cached costs the plan came from (the
    agreement stays: greedy paths do not depend on the node's load), so that the next job
    measures them again. (AR is checked on its own: costs cached beside a busy process can put AR
    far off while the chosen option's own prediction still holds; docs/notebook.md, "Measurements
    behind the code's choices".) Under the online plan, every plan it measured is set beside its
    prediction (``online_vs_predicted``) and checked too. What was measured updates the node's
    refit (``memory``: plan/refit.py), which the next plan's predictions are corrected by."""
    summary = read_summary(run_dir / SUMMARY)
    chosen, ar_pred = record.plan.chosen, record.plan.ar
    kw: dict = {"measured_ms_per_token": {k: s.ms_per_token for k, s in summary.items()}}
    b = chosen.batch_size
    mine, ar = find_entry(summary, chosen.method, b), find_entry(summary, "ar", b)
    got = mine.ms_per_token if mine else None
    seen: dict[str, Observation] = {}  # what, as it is reported -> measured against predicted
    if got:
        kw["measured_vs_predicted"] = round(got / chosen.ms_per_token, 3)
        if ar and ar.ms_per_token:
            kw["measured_speedup"] = round(ar.ms_per_token / got, 3)
        print(
            f"[pipespec_mpi] auto: {group_key(chosen.method, b)} measured {got:.2f} ms/token, "
            f"predicted {chosen.ms_per_token:.2f} (AR predicted {ar_pred.ms_per_token:.2f})",
            flush=True,
        )
        mine_seen = Observation(chosen.method, chosen.pipeline, b, got, chosen.ms_per_token)
        seen[group_key(chosen.method, b)] = mine_seen
    ar1 = find_entry(summary, "ar", 1)
    if ar1 and ar1.ms_per_token and chosen != ar_pred:
        kw["ar_measured_vs_predicted"] = round(ar1.ms_per_token / ar_pred.ms_per_token, 3)
        seen["ar"] = Observation("ar", ar_pred.pipeline, 1, ar1.ms_per_token, ar_pred.ms_per_token)
    online = run_dir / ONLINE
    if online.is_file():  # method=online: every plan it measured, against its prediction
        ran = online_observations(record.plan, json.loads(online.read_text()))
        kw["online_vs_predicted"] = {
            name: {"measured": o.measured, "predicted": round(o.predicted, 4) if o.predicted else None}
            for (name, batch), o in ran.items() if batch == 1
        }  # fmt: skip
        seen.update({f"{name} @{batch}": o for (name, batch), o in ran.items() if o.predicted})
    off = [(w, o.measured, o.predicted) for w, o in seen.items()
           if not within(o.measured, o.predicted, off_factor)]  # fmt: skip
    if off:
        costs = record.calibration.cache_files.get("costs")
        if costs:
            Path(costs).unlink(missing_ok=True)
        what = "; ".join(f"{w} measured {m:.2f} ms/token, {m / p:.2f}x its prediction" for w, m, p in off)
        kw["prediction_off"] = (
            f"{what} (more than {off_factor:g}x apart): the cached costs it was planned from are dropped "
            f"({costs}); the next job measures them again"
        )
        log.warning("auto: %s", kw["prediction_off"])
        print(f"[pipespec_mpi] auto: {kw['prediction_off']}", flush=True)
    if memory is not None and record.inputs is not None and seen:
        kw["refit_next"] = refit = record.inputs.refit.updated(seen.values())
        memory.save(refit)
    record = dataclasses.replace(record, **kw)
    write_plan(run_dir, record)
    return record


def online_observations(plan: Plan, online: dict) -> dict[tuple[str, int], Observation]:
    """Each plan the online plan ran in this job (``online.json``: its name and batch size) with its
    measured ms/token and the offline plan's prediction for its method on its stages at that
    batch size (0: not predicted)."""
    pipeline, _ = online_pipeline(plan)
    out = {}
    for batch, node in online.items():
        b = int(batch)
        ran = node.get("runs", {})
        for name, ms in node.get("ms_per_token", {}).items():
            if not ran.get(name):  # an estimate remembered from an earlier job, not measured in this one
                continue
            method, _, route = name.partition(" ")
            stages = (pipeline[-1],) if method == "ar" else tuple(pipeline[i] for i in parse_route(route))
            predicted = [o.ms_per_token for o in plan.options
                         if o.method == method and o.pipeline == stages and o.batch_size == b]  # fmt: skip
            out[name, b] = Observation(method, stages, b, ms, min(predicted, default=0.0))
    return out
