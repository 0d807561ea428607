"""Job-array shard bookkeeping (pure parts; the Slurm round trip is in tests/slurm)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pipespec_mpi.config import compose_config
from pipespec_mpi.shards import ShardError, array_spec, expected_jobs, shard_dirs, status


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
