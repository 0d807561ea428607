"""slurm.json: the job as Slurm's environment describes it (pure)."""

from __future__ import annotations

import json

from pipespec_mpi.run.slurm_info import SLURM_JSON, append_slurm_record, slurm_record

ENV = {
    "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NTASKS": "6", "SLURM_CPUS_PER_TASK": "4", "SLURM_RESTART_COUNT": "1",
    "SLURM_JOB_START_TIME": "1000", "SLURM_JOB_END_TIME": "4600", "SLURM_JOB_PARTITION": "gpu",
}  # fmt: skip


def test_the_record_has_ids_nodes_requeues_and_time():
    rec = slurm_record(ENV, now=1600.0)
    assert rec["job_id"] == "42" and rec["node_list"] == "node[01-02]" and rec["partition"] == "gpu"
    assert (rec["n_nodes"], rec["n_tasks"], rec["cpus_per_task"], rec["restart_count"]) == (2, 6, 4, 1)
    assert rec["elapsed_s"] == 600.0 and rec["time_left_s"] == 3000.0


def test_nothing_outside_slurm_and_no_times_where_slurm_sets_none(tmp_path):
    assert slurm_record({"HOME": "/root"}, now=0.0) is None
    append_slurm_record(tmp_path, {})
    assert not (tmp_path / SLURM_JSON).exists()
    rec = slurm_record({"SLURM_JOB_ID": "7"}, now=0.0)
    assert rec["restart_count"] == 0 and "elapsed_s" not in rec


def test_each_run_of_a_directory_appends(tmp_path):
    append_slurm_record(tmp_path, ENV)
    append_slurm_record(tmp_path, {**ENV, "SLURM_RESTART_COUNT": "2"})
    runs = json.loads((tmp_path / SLURM_JSON).read_text())
    assert [r["restart_count"] for r in runs] == [1, 2]
