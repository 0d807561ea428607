"""A user's dataset for the tests of dataset jobs (tests/mpi/test_user_files.py and the Slurm
array in tests/slurm/test_slurm.py): a folder with a Parquet file of chat rows with their own
settings and an OpenAI batch JSONL with one bad request and a line that is not JSON."""

from __future__ import annotations

import json
from pathlib import Path

from pipespec_mpi.records import RESULTS, read_records

TOPICS = ["the draft model", "a verify stage", "rank cache epoch", "pipeline node cluster"]


def write_rows(folder: Path) -> dict[str, dict]:
    """a.parquet: chat rows with their own settings; b.jsonl: OpenAI batch requests, one of them
    bad, and a line that is not JSON. Returns every row's id -> what it asked for."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    chat = [
        {"id": f"chat-{i}", "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": t}],
         "max_tokens": 6 + i, "temperature": 0.7 if i == 3 else None, "seed": 5}
        for i, t in enumerate(TOPICS)
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(chat), folder / "a.parquet")
    batch = [
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": t, "max_tokens": 10}}
        for i, t in enumerate(TOPICS)
    ]  # fmt: skip
    batch.append({"custom_id": "req-bad", "url": "/v1/chat/completions", "body": {"messages": []}})
    with open(folder / "b.jsonl", "w") as f:
        for r in batch:
            f.write(json.dumps(r) + "\n")
        f.write("{torn\n")
    rows = {r["id"]: {"max_tokens": r["max_tokens"], "temperature": r["temperature"]} for r in chat}
    rows.update({r["custom_id"]: r.get("body", {}) for r in batch})
    rows["9"] = {}  # the line that is not JSON: named by its position
    return rows


def answered(run_dir: Path) -> tuple[list[str], list[str]]:
    """The ids of results.jsonl's records and of errors.jsonl's rows."""
    results = [r.prompt_id for r in read_records(run_dir / RESULTS)]
    errors = [json.loads(x) for x in (run_dir / "errors.jsonl").read_text().splitlines()]
    return results, [e["id"] if e["id"] is not None else str(e["position"]) for e in errors]
