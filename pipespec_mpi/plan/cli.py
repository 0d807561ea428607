"""``pipespec-plan``: the planner's command line (one search: search.py; one table: table.py).

  pipespec-plan                      # the paper's models (simulate/paper.py)
  pipespec-plan --config plan.yaml   # your latency profiles and acceptance rates
  pipespec-plan RUN_DIR              # profiles and rates measured in a run
  pipespec-plan --measure [--ranks 3] [OVERRIDES]  # measure here, as hierarchy=auto does
                                                   # (auto.force=true: ignore the cache)

Settings are the app's keys (``decode.max_new_tokens=64 decode.max_run_ahead=16``,
``run.epochs_window=rma``, ``auto.max_stages=2``), checked as a job checks them; the search grid
(``--lookaheads``, ``--sd-windows``, ``--run-aheads``) is the planner's own.

It searches hierarchies (every ordered choice of distinct drafters in front of the target: subsets
and orderings of the available models) with every setting of the grid (SD windows, PipeSpec
lookaheads, run-aheads, the adaptive policy), predicts each (pipespec_mpi/simulate/: i.i.d.
acceptance for a plan file or a run; the paper's traces for the paper; replayed calibration
prompts for ``--measure``) and prints the best configurations per method with their predicted
speedup over AR, as Hydra overrides ready to paste after ``mpirun -n <stages> python -m pipespec_mpi``
(``--measure``: the fastest options and the choice, as ``hierarchy=auto`` would make it).

A plan config (YAML or JSON):

  hierarchy: tiny                  # optional: conf/hierarchy/<name>.yaml, for the overrides
  target: tiny-target-4L           # the model whose output is wanted (default: the slowest)
  latency_ms: 0.5                  # per-message latency between stages (default 0)
  blocking_reads: false            # header reads wait for a computing stage (MPI RMA, MPICH)
  models:                          # forward time in ms by number of tokens; loop overhead
    tiny-draft-1L: {forward_ms: {1: 0.9, 16: 1.2}, overhead_ms: 0.1}
    tiny-mid-3L: {forward_ms: {1: 2.0, 16: 2.8}}
    tiny-target-4L: {forward_ms: {1: 2.2, 16: 3.0}}
  acceptance:                      # i.i.d. rate per (drafter -> verifier) pair
    tiny-draft-1L -> tiny-mid-3L: 0.66
    tiny-mid-3L -> tiny-target-4L: 0.82
    tiny-draft-1L -> tiny-target-4L: 0.60

A hierarchy needs a rate for each adjacent pair; with ``--transitive`` a missing a -> c is
estimated as rate(a -> b) * rate(b -> c) through a known b (a lower bound under the simulator's
token model), otherwise the hierarchy is skipped.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import replace

from pipespec_mpi.config import AppConfig, DecodeConfig, compose_config, compose_tool_config, split_tool_args
from pipespec_mpi.errors import UserError, tool_error
from pipespec_mpi.plan.options import Grid
from pipespec_mpi.plan.realize import overrides
from pipespec_mpi.plan.search import search
from pipespec_mpi.plan.sources import PlanInputs, RateSource, inputs_from_run, load_plan_config, paper_inputs
from pipespec_mpi.plan.table import table

PROG = "pipespec-plan"


def _ints(text: str | None) -> tuple[int, ...] | None:
    return tuple(int(x) for x in text.split(",") if x.strip()) if text else None


SETTINGS = ("decode", "run.epochs_window", "auto.max_stages")  # the app's keys it reads (no --measure)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("args", nargs="*", metavar="RUN_DIR | KEY=VALUE",
                    help="a run directory (plan from what it measured), and settings as the app's keys: "
                         "decode.max_new_tokens, decode.max_run_ahead, decode.max_verify, "
                         "run.epochs_window=rma (header reads wait), auto.max_stages; with --measure, "
                         "any of the job's overrides")  # fmt: skip
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--config", help="a plan config (YAML or JSON)")
    src.add_argument("--preset", choices=["paper"], help="the paper's models (the default)")
    src.add_argument(
        "--measure",
        action="store_true",
        help="measure the candidate stages on this machine and choose, as hierarchy=auto does "
        "(default hierarchy=auto)",
    )
    ap.add_argument("--ranks", type=int, default=3, help="with --measure: the job's world size")
    ap.add_argument("--lookaheads", default=None, help="PipeSpec lookaheads to try (default 0,1,2,4,8)")
    ap.add_argument("--sd-windows", default=None, help="SD windows to try (default 1,2,3,4,6,8)")
    ap.add_argument(
        "--run-aheads", default=None, help="PipeSpec run-ahead bounds to try (default: the bound)"
    )
    ap.add_argument(
        "--seeds", type=int, default=None, help="simulations per candidate (default 3; the paper: 8)"
    )
    ap.add_argument("--transitive", action="store_true", help="estimate missing pair rates")
    ap.add_argument("--top", type=int, default=None,
                    help="configurations per method (default 3; --measure: rows, default 8)")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    run_dirs, settings = split_tool_args(a.args)
    if len(run_dirs) > 1 or (run_dirs and (a.config or a.preset or a.measure)):
        ap.error(f"one source: a run directory, --config, --preset or --measure (got {run_dirs})")
    if a.measure:
        return measure_main(settings, a.ranks, a.top or 8)
    run_dir = run_dirs[0] if run_dirs else None
    try:
        cfg, given = compose_tool_config(settings, SETTINGS)
        if run_dir:
            from pipespec_mpi.plan.job import replan

            again = replan(run_dir)  # a hierarchy=auto run: what it planned from, planned again
            if again is not None:
                print(f"inputs: {run_dir}/plan.json (the measurements hierarchy=auto planned from)")
                print(table(again, a.top or 8))
                return 0
        if a.config:
            inp = load_plan_config(a.config)
        elif run_dir:
            inp = inputs_from_run(run_dir)
        else:
            inp = paper_inputs()
        if "run.epochs_window" in given:
            inp = replace(inp, blocking_reads=cfg.run.epochs_window == "rma")
        plan = plan_from(inp, a, cfg, given)
    except (OSError, ValueError, KeyError) as err:
        return tool_error(PROG, err)
    top = a.top or 3
    if a.json:
        rows = [
            {"method": o.method, "models": list(o.pipeline), "lookahead": o.window, "run_ahead": o.run_ahead,
             "policy": o.policy, "ms_per_token": o.ms_per_token, "speedup": o.speedup,
             "overrides": overrides(o, inp)}
            for group in plan.best(top).values()
            for o in group
        ]  # fmt: skip
        print(json.dumps(rows, indent=2))
    else:
        print(f"inputs: {inp.source}; target {inp.target}; latency {1000 * inp.latency_s:.2f} ms; "
              f"blocking header reads: {'yes' if inp.blocking_reads else 'no'}")  # fmt: skip
        command = lambda o: f"mpirun -n {len(o.pipeline)} python -m pipespec_mpi {overrides(o, inp)}"  # noqa: E731
        print(table(plan, top, per_method=True, command=command))
    return 0


def plan_from(inp: PlanInputs, a: argparse.Namespace, cfg: AppConfig, given: set[str]):
    """The search over a plan file's, a run's or the paper's models, as the command line sets it:
    the keys it names, else the paper's setting (for the paper), else the app's defaults."""
    paper = inp.paper
    d = cfg.decode

    def setting(key: str, paper_value: int | None, default: int) -> int:
        return getattr(d, key) if f"decode.{key}" in given else paper_value if paper else default

    decode = DecodeConfig(
        # 128 tokens per simulated prompt unless set: enough draft positions for the acceptance
        max_new_tokens=setting("max_new_tokens", paper and paper.n_tokens, 128),
        max_run_ahead=setting("max_run_ahead", paper and paper.max_run_ahead, d.max_run_ahead),
        max_verify=setting("max_verify", paper and paper.max_verify, d.max_verify),
        policy="static",
    )
    g = Grid()
    grid = Grid(
        lookaheads=_ints(a.lookaheads) or g.lookaheads,
        sd_windows=_ints(a.sd_windows) or g.sd_windows,
        run_aheads=_ints(a.run_aheads) or g.run_aheads,
    )
    seeds = tuple(range(a.seeds or (len(paper.seeds) if paper else 3)))
    return search(RateSource(inp, seeds, a.transitive), decode, grid, cfg.auto.max_stages)


def measure_main(hydra_overrides: Sequence[str], ranks: int, top: int = 8) -> int:
    """``--measure``: what ``mpirun -n RANKS python -m pipespec_mpi OVERRIDES`` with
    ``hierarchy=auto`` would measure and choose here, printed, with the command that runs it."""
    from pipespec_mpi.auto.calibrate import Node, calibrate, calibration_prompts
    from pipespec_mpi.models.loader import load_tokenizer
    from pipespec_mpi.plan.job import choose

    hydra_overrides = list(hydra_overrides)
    if not any(o.startswith("hierarchy=") for o in hydra_overrides):
        hydra_overrides.insert(0, "hierarchy=auto")
    try:
        cfg = compose_config(hydra_overrides)
        if not cfg.hierarchy.choose:
            hydra_overrides.append("hierarchy.choose=true")
            cfg = compose_config(hydra_overrides)
        node = Node.here(cfg.auto.replicas, ranks, ranks_on_node=ranks, bound=False)
        tok = load_tokenizer(cfg.hierarchy.tokenizer, cfg.hierarchy.name)
        cal = calibrate(cfg, calibration_prompts(cfg, tok), tok.eos_token_id, node)
        plan = choose(cfg, cal, node)
    except (UserError, ValueError, OSError) as err:
        return tool_error(PROG, err)
    got = "from the cache: " + ", ".join(cal.cached) if cal.cached else "measured"
    if cal.spot:
        spot = cal.spot.to_json()
        got += f" (target step {spot['measured_ms']} ms now, {spot['cached_ms']} cached: {spot['verdict']})"
    if cal.phases:
        got += " (" + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in cal.phases.items()) + ")"
    print(f"candidates: {cfg.hierarchy.name} ({', '.join(s.name for s in cfg.hierarchy.stages)}); "
          f"{node.cores} cores, {ranks} ranks; {got} in {cal.seconds:.1f} s")  # fmt: skip
    print(table(plan, top))
    shown = " ".join(o for o in hydra_overrides if not o.startswith("auto.force"))
    print(f"    mpirun -n {ranks} python -m pipespec_mpi {shown}")
    return 0
