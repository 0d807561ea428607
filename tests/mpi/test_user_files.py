"""Dataset jobs over the user's own files under real mpirun (README "Run your own dataset"): a
Parquet file of chat rows and an OpenAI batch JSONL, with per-row settings and bad rows, through a
two-replica job; every row answered once (results or errors.jsonl), read back by pyarrow and by a
plain JSONL reader; greedy rows identical to the target alone; on_error=fail; the start-up
watchdog."""

from __future__ import annotations

import json
import re
import time

import pytest
from conftest import launch, launch_ok
from user_rows import answered, write_rows

from pipespec_mpi.records import RESULTS, read_records

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def test_a_parquet_and_an_openai_batch_file_through_two_replicas(tmp_path):
    import pyarrow.parquet as pq

    rows = write_rows(tmp_path / "rows")
    common = ["hierarchy=tiny2", "dataset=files", f"dataset.path={tmp_path / 'rows'}",
              "decode.max_new_tokens=12", "sampling.coupling=gumbel"]  # fmt: skip
    # rounds of 2 rows per replica (run/rows.py): the 8 good rows reach the replicas in 2 rounds
    records = launch_ok(4, [*common, "run.output_format=parquet", "dataset.round_rows=2"], tmp_path / "spec",
                        timeout=300)  # fmt: skip
    results, errors = answered(tmp_path / "spec")
    assert sorted(results + errors) == sorted(rows), (results, errors)  # every row once
    assert sorted(errors) == ["9", "req-bad"]
    assert {r.replica for r in records} == {0, 1}
    by_id = {r.prompt_id: r for r in records}
    for i in range(4):
        chat = by_id[f"chat-{i}"]
        assert chat.request == "chat" and chat.max_new_tokens == 6 + i
        assert chat.n_new_tokens <= 6 + i and chat.temperature == (0.7 if i == 3 else 0.0)
        assert by_id[f"req-{i}"].openai and by_id[f"req-{i}"].max_new_tokens == 10
    table = pq.read_table(tmp_path / "spec" / "results.parquet").to_pylist()
    assert sorted(t["id"] for t in table) == sorted(results)
    assert all(t["output_ids"] == by_id[t["id"]].output_ids for t in table)

    # the same rows decoded by the target alone, written as OpenAI batch output
    launch_ok(2, [*common, "method=ar", "run.output_format=openai"], tmp_path / "ar", timeout=300)
    lines = [json.loads(x) for x in (tmp_path / "ar" / "results.openai.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(rows)
    ar = {x["custom_id"]: x for x in lines}
    assert ar["req-bad"]["response"] is None and "non-empty list" in ar["req-bad"]["error"]["message"]
    assert ar["chat-0"]["response"]["body"]["object"] == "chat.completion"
    assert ar["req-0"]["response"]["body"]["object"] == "text_completion"
    ar_records = {r.prompt_id: r for r in read_records(tmp_path / "ar" / RESULTS)}
    # greedy rows token for token; the sampled one too: under the gumbel coupling every method
    # draws with the same noise, so PipeSpec's sample is the target's own
    assert {rid: r.output_ids for rid, r in by_id.items()} == {
        rid: ar_records[rid].output_ids for rid in by_id
    }


def test_on_error_fail_stops_at_the_first_bad_row_and_names_it(tmp_path):
    write_rows(tmp_path / "rows")
    proc = launch(2, ["hierarchy=tiny2", "dataset=files", f"dataset.path={tmp_path / 'rows'}",
                      "run.on_error=fail"], tmp_path / "run", timeout=200)  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "row 8" in proc.stderr and "req-bad" in proc.stderr and "run.on_error=skip" in proc.stderr
    assert json.loads((tmp_path / "run" / "errors.jsonl").read_text().splitlines()[0])["id"] == "req-bad"


def test_a_rendezvous_that_cannot_happen_ends_within_the_start_up_limit_naming_the_phase(tmp_path):
    """Rank 1 never reaches the rendezvous (as a host whose port nothing answers): the others
    end the job after run.startup_timeout_s (tighter here than transport.rendezvous_timeout_s),
    naming the step, the missing rank, their own rank and the hosts."""
    t0 = time.monotonic()
    over = ["hierarchy=tiny", "dataset=synthetic", "transport.kind=gloo", "run.startup_timeout_s=10"]
    hang = {"PIPESPEC_INJECT_FAULT": "hang@1:rendezvous"}
    proc = launch(3, over, tmp_path / "run", timeout=200, env=hang)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    # rank 0 or 2 (whichever aborts first; the other may be killed before it writes)
    named = (r"start-up phase 'rendezvous \(gloo\): check-in' failed: rank 1 \(\S+\) did not reach "
             r"the rendezvous within 10 s \(run.startup_timeout_s\) on rank [02] ")  # fmt: skip
    assert re.search(named, out), out[-3000:]
    assert took < 120, took
    log = (tmp_path / "run" / "rank1.log").read_text()
    assert "start-up: rendezvous (gloo)" in log  # the hung rank said what it was doing
