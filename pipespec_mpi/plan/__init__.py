"""One answer to "what should I run?": one search over one grid of settings, fed by adapters.

options.py  Setting, Option, Grid (AUTO_GRID), Plan: the vocabulary
search.py   search(source, decode, grid, max_stages, margin): predict every (pipeline,
            setting), rank, choose; the Source protocol
sources.py  MeasuredSource (this node's measured costs and agreement, auto/), RateSource
            (profiles and rates: a plan file, a past run's fit, the paper's setting)
realize.py  the config (realize) or the Hydra overrides that run an option; select_stages
table.py    the planner's table (laid out by analysis/table.py, as every tool's)
record.py   plan.json typed (PlanRecord, SearchInputs): write_plan, read_plan
job.py      hierarchy=auto in an MPI job: measure on rank 0, choose, run the choice
memory.py   the online plan's estimates kept in the node's cache for the next job
cli.py      pipespec-plan (--config, RUN_DIR, --preset paper, --measure)
"""

from pipespec_mpi.plan.cli import main

__all__ = ["main"]
