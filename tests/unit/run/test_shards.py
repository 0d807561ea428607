"""Job-array shard bookkeeping (pure parts; the Slurm round trip is in tests/slurm)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipespec_mpi.config import compose_config
from pipespec_mpi.run.shards import ShardError, array_spec, expected_jobs, shard_dirs, status


def test_array_spec_joins_runs_of_ids():
    assert array_spec([3, 0, 1, 2, 7, 9, 10]) == "0-3,7,9-10"
    assert array_spec([5]) == "5" and array_spec([]) == ""


def test_expected_jobs_cover_the_prompts_once_over_the_shards():
    cfg = compose_config(["hierarchy=tiny", "dataset=synthetic", "dataset.n_prompts=7",
                          "run.mode=benchmark", "dataset.shard_count=3"])  # fmt: skip
    per_shard = [expected_jobs(replace(cfg, dataset=replace(cfg.dataset, shard_index=i))) for i in range(3)]
    assert [len(s) // 3 for s in per_shard] == [3, 2, 2]  # prompts 0,3,6 / 1,4 / 2,5; three methods
    union = set().union(*per_shard)
    assert len(union) == sum(len(s) for s in per_shard) == 7 * 3


def test_a_directory_without_shards_is_an_error(tmp_path):
    (tmp_path / "shard-x").mkdir()
    assert shard_dirs(tmp_path) == {}
    with pytest.raises(ShardError, match="no shard-<i>/"):
        status(tmp_path)


def test_a_shards_bad_rows_are_not_expected_of_it(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(5)) + "not json\n")
    cfg = compose_config(["hierarchy=tiny", "dataset=files", f"dataset.path={rows}", "dataset.shard_count=2"])
    shard0 = expected_jobs(cfg)  # rows 0, 2, 4 (row 5, not JSON, is shard 1's and never expected)
    assert {k[0] for k in shard0} == {"0", "2", "4"}
    assert {k[0] for k in expected_jobs(cfg, bad_positions={2})} == {"0", "4"}  # errors.jsonl's
    shard1 = expected_jobs(replace(cfg, dataset=replace(cfg.dataset, shard_index=1)))
    assert {k[0] for k in shard1} == {"1", "3"}


def test_the_array_script_a_resubmission_runs_exists():
    from pipespec_mpi.run.shards import ARRAY_SCRIPT

    assert ARRAY_SCRIPT.is_file(), ARRAY_SCRIPT


def test_status_table_rows_and_totals():
    from pipespec_mpi.run.shards import ShardState, format_status

    states = [ShardState(0, 4, 4, True, errors=1, tokens=400, span_s=10.0),
              ShardState(1, 4, 2, True, tokens=100, span_s=20.0), ShardState(2, 4, 0, False)]  # fmt: skip
    lines = format_status(states).splitlines()
    assert lines[0].split() == ["shard", "done", "expected", "state", "bad", "rows", "tokens/s", "ETA", "min"]
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("shard-")}
    assert rows["shard-0"] == ["shard-0", "4", "4", "finished", "1", "40.0", "0.0"]
    assert rows["shard-1"] == ["shard-1", "2", "4", "unfinished", "0", "5.0", "0.3"]  # 2 more at 10 s each
    assert rows["shard-2"] == ["shard-2", "0", "4", "not", "started", "0", "-", "-"]
    assert (
        "array: 6/12 jobs done, 1 bad rows, 500 tokens, ETA 0.3 min" in lines[-2]
        and lines[-1] == "missing: 1-2"
    )
