"""A run's results in the formats other tools read (``run.output_format``), beside results.jsonl:

openai   ``results.openai.jsonl``: one OpenAI batch output line per request (``custom_id``, a
         ``response`` with ``status_code`` 200 and a chat.completion or text_completion body with
         ``usage``), what ``vllm run-batch`` and the cloud batch APIs write; a bad row is a line
         of its own with ``response: null`` and its ``error``, so every input row is answered
         once. Our per-request speculative metrics ride beside them under ``pipespec``.
parquet  ``results.parquet``: one row per record, flat columns (pandas, pyarrow, datasets load
         it); written a row group at a time.

A request sampled ``sampling.num_samples`` times is one OpenAI line with that many ``choices``;
a benchmark (several methods, batch sizes) writes one line per request and method and batch size.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from pipespec_mpi.records import Record

OPENAI = "results.openai.jsonl"
PARQUET = "results.parquet"
FINISH = {"eos": "stop", "length": "length"}  # our finish_reason -> OpenAI's


def _accepted_per_verification(r: Record) -> dict[str, float]:
    """Mean tokens accepted per verification at each stage pair ("0->1": stage 1's verifications
    of stage 0's proposals)."""
    return {
        f"{up}->{i}": round(r.stages[i].tokens_accepted / r.stages[i].verifications, 3)
        for up, i in r.pairs()
        if r.stages[i].verifications
    }


def _digest(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def openai_line(group: Sequence[Record], model: str) -> dict:
    """The OpenAI batch output line answering one request (its records: one per sample)."""
    first = group[0]
    chat = first.request == "chat"
    choices = []
    for r in sorted(group, key=lambda r: r.sample_idx):
        finish = FINISH.get(r.finish_reason, r.finish_reason)
        if chat:
            choices.append({"index": r.sample_idx, "message": {"role": "assistant", "content": r.text},
                            "finish_reason": finish, "logprobs": None})  # fmt: skip
        else:
            choices.append({"index": r.sample_idx, "text": r.text, "finish_reason": finish, "logprobs": None})
    completion = sum(r.n_new_tokens for r in group)
    prompt = len(first.prompt_ids)
    body = {
        "id": ("chatcmpl-" if chat else "cmpl-") + _digest(first.prompt_id, first.method, first.batch_size),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(max((r.end_time or 0) for r in group)),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    rid = _digest("request", first.prompt_id, first.method, first.batch_size)
    return {
        "id": f"batch_req_{rid}",
        "custom_id": first.prompt_id,
        "response": {"status_code": 200, "request_id": rid, "body": body},
        "error": None,
        "pipespec": {
            "method": first.method,
            "batch_size": first.batch_size,
            "hierarchy": first.hierarchy,
            "models": first.models,
            "ms_per_token": [round(r.ms_per_token, 3) for r in group],
            "ttft_s": [round(r.ttft_s, 4) for r in group],
            "accepted_per_verification": [_accepted_per_verification(r) for r in group],
            "truncated_tokens": first.truncated_tokens,
        },
    }


def openai_error_line(row: dict) -> dict:
    """The line of a row that was not decoded (``errors.jsonl``'s object)."""
    cid = row.get("id") if row.get("id") is not None else str(row.get("position"))
    return {
        "id": f"batch_req_{_digest('error', cid, row.get('position'))}",
        "custom_id": cid,
        "response": None,
        "error": {"code": "invalid_request", "message": row.get("reason"), "line": row.get("source")},
    }


def _row_groups(records: Iterable[Record]) -> Iterator[tuple[int, list[Record]]]:
    """(position, records) of each request's (prompt, method, batch size) in turn, from records
    in row order (results.jsonl's): a row's records are consecutive, so one row is held at a
    time; warm-ups are left out."""
    row: dict[tuple, list[Record]] = {}
    at = None
    for r in records:
        if r.warmup:
            continue
        pos = r.position if r.position is not None else -1
        if row and pos != at:
            yield from ((at, g) for g in row.values())
            row = {}
        at = pos
        row.setdefault((r.prompt_id, r.method, r.batch_size), []).append(r)
    yield from ((at, g) for g in row.values())


def write_openai(path: Path, records: Iterable[Record], errors: Sequence[dict], model: str) -> int:
    """results.openai.jsonl in row order (errors in their place) from ``records`` in row order,
    written as they come; the lines written."""
    decoded = ((pos, json.dumps(openai_line(g, model))) for pos, g in _row_groups(records))
    failed = sorted(((e.get("position", -1), json.dumps(openai_error_line(e))) for e in errors),
                    key=lambda t: t[0])  # fmt: skip
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for _, line in heapq.merge(decoded, failed, key=lambda t: t[0]):
            f.write(line + "\n")
            n += 1
    return n


def parquet_row(r: Record) -> dict:
    acc = _accepted_per_verification(r)
    return {
        "id": r.prompt_id, "position": r.position, "method": r.method, "sample_idx": r.sample_idx,
        "batch_size": r.batch_size, "request": r.request, "text": r.text, "output_ids": r.output_ids,
        "n_new_tokens": r.n_new_tokens, "prompt_tokens": len(r.prompt_ids), "finish_reason": r.finish_reason,
        "truncated_tokens": r.truncated_tokens, "temperature": r.temperature, "wall_s": r.wall_s,
        "ms_per_token": r.ms_per_token, "ttft_s": r.ttft_s,
        # the last pair's: the target's verifications (None for AR)
        "accepted_per_verification": acc[max(acc)] if acc else None, "hierarchy": r.hierarchy,
    }  # fmt: skip


def write_parquet(path: Path, records: Iterable[Record], rows_per_group: int = 4096) -> int:
    """results.parquet, a row group per ``rows_per_group`` records; the rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([
        ("id", pa.string()), ("position", pa.int64()), ("method", pa.string()), ("sample_idx", pa.int32()),
        ("batch_size", pa.int32()), ("request", pa.string()), ("text", pa.string()),
        ("output_ids", pa.list_(pa.int32())), ("n_new_tokens", pa.int32()), ("prompt_tokens", pa.int32()),
        ("finish_reason", pa.string()), ("truncated_tokens", pa.int32()), ("temperature", pa.float64()),
        ("wall_s", pa.float64()), ("ms_per_token", pa.float64()), ("ttft_s", pa.float64()),
        ("accepted_per_verification", pa.float64()), ("hierarchy", pa.string()),
    ])  # fmt: skip
    n, chunk = 0, []
    with pq.ParquetWriter(path, schema) as writer:
        for r in records:
            if r.warmup:
                continue
            chunk.append(parquet_row(r))
            if len(chunk) == rows_per_group:
                writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
                n, chunk = n + len(chunk), []
        if chunk or not n:
            writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
            n += len(chunk)
    return n


def write_outputs(
    fmt: str, run_dir: Path, records: Iterable[Record], errors: Sequence[dict], model: str
) -> None:
    """The extra file of ``run.output_format`` (jsonl: none, results.jsonl is it)."""
    if fmt == "openai":
        write_openai(run_dir / OPENAI, records, errors, model)
    elif fmt == "parquet":
        write_parquet(run_dir / PARQUET, records)
