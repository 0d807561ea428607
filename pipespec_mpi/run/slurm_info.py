"""What Slurm says about the job a run ran in, kept beside its results (``slurm.json``).

One entry per run of the directory (a resumed or requeued job appends its own), from the
environment Slurm gives every task: job and array ids, partition, nodes, tasks, CPUs per task,
how often Slurm restarted the job (requeues), and, where this Slurm sets them
(``SLURM_JOB_START_TIME``/``SLURM_JOB_END_TIME``, 23.02+), the seconds the job had run and had left.
Outside Slurm nothing is written.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path

SLURM_JSON = "slurm.json"
FIELDS = {
    "job_id": "SLURM_JOB_ID",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "job_name": "SLURM_JOB_NAME",
    "partition": "SLURM_JOB_PARTITION",
    "node_list": "SLURM_JOB_NODELIST",
    "n_nodes": "SLURM_JOB_NUM_NODES",
    "n_tasks": "SLURM_NTASKS",
    "cpus_per_task": "SLURM_CPUS_PER_TASK",
    "restart_count": "SLURM_RESTART_COUNT",
    "submit_dir": "SLURM_SUBMIT_DIR",
}


def slurm_record(env: Mapping[str, str], now: float) -> dict | None:
    """The job as Slurm's environment describes it at ``now`` (epoch seconds); None outside Slurm."""
    if "SLURM_JOB_ID" not in env:
        return None
    rec: dict = {k: env[v] for k, v in FIELDS.items() if v in env}
    for k in ("n_nodes", "n_tasks", "cpus_per_task", "restart_count"):
        if str(rec.get(k, "")).isdigit():
            rec[k] = int(rec[k])
    rec.setdefault("restart_count", 0)
    start, end = env.get("SLURM_JOB_START_TIME", ""), env.get("SLURM_JOB_END_TIME", "")
    if start.isdigit():
        rec["elapsed_s"] = round(now - int(start), 1)
    if end.isdigit():
        rec["time_left_s"] = round(int(end) - now, 1)
    rec["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now))
    return rec


def append_slurm_record(run_dir: Path, env: Mapping[str, str]) -> None:
    rec = slurm_record(env, time.time())
    if rec is None:
        return
    path = Path(run_dir) / SLURM_JSON
    try:
        runs = json.loads(path.read_text())
    except (OSError, ValueError):
        runs = []
    path.write_text(json.dumps([*runs, rec], indent=1) + "\n")
