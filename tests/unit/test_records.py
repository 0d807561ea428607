"""The run directory's files as types: results.jsonl records, summary.json, benchmark.json."""

from __future__ import annotations

import json
import pickle
from dataclasses import fields
from pathlib import Path

import pytest

from pipespec_mpi.analysis.metrics import benchmark_table, summarize
from pipespec_mpi.records import (
    BenchmarkRow,
    MethodSummary,
    Record,
    RecordError,
    drop_torn_tail,
    read_benchmark,
    read_records,
    read_summary,
    write_benchmark,
    write_records,
    write_summary,
)
from pipespec_mpi.stage.stats import StageStats


def make_record(method: str = "pipespec", prompt: str = "p0", wall: float = 0.5, n: int = 4, **kw) -> Record:
    """A record as the runner writes it, every field set to something other than its default."""
    stages = [
        StageStats(
            stage=s, rank=s, model=f"m{s}", forward_calls=3, draft_steps=2 - s, own_steps=s, verifications=s,
            tokens_proposed=5, tokens_verified=4 * s, tokens_accepted=3 * s, tokens_generated=4,
            tokens_adopted=1, rollbacks=1 - s, rollbacks_signalled=s, tokens_discarded=1 - s,
            discarded_s=0.01, dropped_messages=1, busy_s=wall / 2, wait_s=wall / 4, read_s=0.001,
            prefill_s=0.02, t0_perf_counter=123.5 + s, verify_trace=[[4, 3]] if s else [],
            timeline=[[0.0, 0.02, "prefill", 5, 5], [0.02, 0.1, "verify" if s else "draft", 1, 6]],
            commit_times=[[0.1, 1], [wall, n]] if s else [], peak_rss_mb=100.0 + s, bytes_sent=40 * (1 - s),
            gpus=[{"device": s, "energy_j": 2.0, "util_mean": 50.0, "mem_peak_mb": 10.0}],
        )
        for s in range(2)
    ]  # fmt: skip
    base = dict(
        prompt_id=prompt, replica=1, method=method, warmup=False, sample_idx=2, temperature=0.7,
        coupling="gumbel", bytes_sent=[40, 0], seq=7, prompt_ids=[256, 1, 2, 3, 4],
        output_ids=[5, 6, 7, 8][:n], text="abcd"[:n], n_new_tokens=n, finish_reason="length",
        wall_s=wall, ms_per_token=1000 * wall / n,
        ttft_s=0.1, window=2, max_run_ahead=8, max_verify=16, max_new_tokens=n, transport="mpi",
        hierarchy="tiny2", models=["m0", "m1"], stages=stages,
    )  # fmt: skip
    return Record(**{**base, **kw})


def test_a_record_round_trips_through_a_file(tmp_path: Path) -> None:
    recs = [make_record(), make_record("ar", "p1", warmup=True, window=None, hierarchy=None)]
    path = tmp_path / "results.jsonl"
    write_records(path, recs)
    back = read_records(path)
    assert back == recs
    assert all(isinstance(st, StageStats) for r in back for st in r.stages)
    # every field is on disk, in the dataclass's order (the order the runner always wrote)
    line = json.loads(path.read_text().splitlines()[0])
    assert list(line) == [f.name for f in fields(Record)]
    assert list(line["stages"][0]) == [f.name for f in fields(StageStats)]
    assert Record.from_json(line) == recs[0] and recs[0].to_json() == line


def _lines(path: Path, objs: list) -> Path:
    path.write_text("".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs))
    return path


def test_a_malformed_middle_line_names_the_file_and_the_line(tmp_path: Path) -> None:
    good = make_record().to_json()
    path = _lines(tmp_path / "results.jsonl", [good, "", '{"prompt_id": "p1", "repl', good])
    with pytest.raises(RecordError, match=r"results\.jsonl:3: not JSON") as err:
        read_records(path)
    assert err.value.path == path and err.value.line == 3
    err.value.collective = True  # as the runner broadcasts it from rank 0 to every rank
    copy = pickle.loads(pickle.dumps(err.value))
    assert str(copy) == str(err.value) and copy.line == 3 and copy.collective
    # a line that is JSON but not a record: a missing field, a value of the wrong type
    missing = {k: v for k, v in good.items() if k != "wall_s"}
    with pytest.raises(RecordError, match=r"results\.jsonl:2: record: missing field 'wall_s'"):
        read_records(_lines(path, [good, missing]))
    bad_type = {**good, "n_new_tokens": "four"}
    with pytest.raises(RecordError, match=r":1: record: n_new_tokens=\"four\" is not an integer"):
        read_records(_lines(path, [bad_type, good]))
    bad_stage = {**good, "stages": [good["stages"][0], {**good["stages"][1], "busy_s": None}]}
    with pytest.raises(RecordError, match=r":1: record\.stages\[1\]: busy_s=null is not a number"):
        read_records(_lines(path, [bad_stage]))
    with pytest.raises(RecordError, match=r":2: record: expected an object, got list"):
        read_records(_lines(path, [good, [1, 2]]))
    # a malformed last line that ends with a newline was written whole: an error too
    with pytest.raises(RecordError, match=r":2: not JSON"):
        read_records(_lines(path, [good, "{oops}"]))


def test_a_torn_last_line_is_skipped_with_a_message(tmp_path: Path, capsys) -> None:
    whole = json.dumps(make_record().to_json())
    path = tmp_path / "replica-0.jsonl"
    path.write_text(whole + "\n" + whole + "\n" + whole[:57])  # killed while writing the third
    assert len(read_records(path)) == 2
    assert f"{path}:3: skipping a torn last line" in capsys.readouterr().err
    # before a resumed run appends, the torn tail is cut so the next record starts a line
    assert drop_torn_tail(path)
    assert path.read_text() == whole + "\n" + whole + "\n"
    assert f"{path}:3: dropping a torn last line" in capsys.readouterr().err
    assert not drop_torn_tail(path) and not drop_torn_tail(tmp_path / "missing.jsonl")
    with open(path, "a") as f:
        f.write(whole + "\n")
    assert len(read_records(path)) == 3
    # a last record whole but for its newline (killed between the two) is kept, and ended
    path.write_text(whole + "\n" + whole)
    assert len(read_records(path)) == 2
    assert not drop_torn_tail(path) and path.read_text() == whole + "\n" + whole + "\n"


def test_old_records_without_the_newer_fields_still_load(tmp_path: Path) -> None:
    """Records of earlier versions: no sample_idx/temperature/coupling/bytes_sent/max_run_ahead/
    max_verify, stages without tokens_generated/tokens_adopted/read_s/t0_perf_counter/peak_rss_mb/
    bytes_sent/gpus; a key a later version may add is ignored."""
    new = make_record().to_json()
    old = {
        k: v
        for k, v in new.items()
        if k not in ("sample_idx", "temperature", "coupling", "bytes_sent", "max_run_ahead", "max_verify")
    }
    old["stages"] = [
        {k: v for k, v in st.items() if k not in ("tokens_generated", "tokens_adopted", "read_s",
                                                  "t0_perf_counter", "peak_rss_mb", "bytes_sent", "gpus")}
        for st in new["stages"]
    ]  # fmt: skip
    old["a_future_field"] = {"x": 1}
    old["lookahead"] = old.pop("window")  # the window's name before it was "window"
    (rec,) = read_records(_lines(tmp_path / "results.jsonl", [old]))
    assert rec.window == new["window"] and "lookahead" not in rec.to_json()
    assert rec.sample_idx == 0 and rec.temperature == 0.0 and rec.bytes_sent == []
    assert rec.max_run_ahead is None and rec.max_verify is None
    st = rec.stages[1]
    assert st.t0_perf_counter == 0.0 and st.read_s == 0.0 and st.tokens_generated == 0 and st.gpus == []
    assert st.verify_trace == [[4, 3]] and st.busy_s == new["stages"][1]["busy_s"]
    assert "a_future_field" not in rec.to_json()
    # aggregates work on them (no energy without NVML samples)
    assert summarize([rec])["pipespec"].energy_j_per_token_system is None


def test_summary_and_benchmark_files_round_trip(tmp_path: Path) -> None:
    recs = [make_record("ar", "p0", 1.0), make_record("ar", "p1", 1.0),
            make_record("pipespec", "p0", 0.5), make_record("pipespec", "p1", 0.25)]  # fmt: skip
    summary = summarize(recs)
    write_summary(tmp_path / "summary.json", summary)
    assert read_summary(tmp_path / "summary.json") == summary
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert list(doc["pipespec"]) == [
        "n_prompts", "n_tokens", "wall_s", "ms_per_token", "tokens_per_s", "ttft_s_mean", "token_latency_ms",
        "acceptance", "mean_accepted_per_verification", "stages", "peak_rss_mb", "batch_size",
        "sequence_ms_per_token", "rows_not_decoded", "energy_j_per_token_system",
        "energy_j_per_token_per_gpu", "n_gpus_measured", "method",
    ]  # fmt: skip
    assert list(doc["pipespec"]["token_latency_ms"]) == ["p50", "p90", "p99"]
    assert doc["pipespec"]["acceptance"]["0->1"]["accepted_histogram"] == [0, 0, 0, 2, 0]
    assert list(doc["pipespec"]["stages"][0]) == [
        "model", "forward_calls", "rollbacks", "tokens_discarded", "discarded_s", "busy_fraction",
        "verifications", "own_steps", "proposals_per_forward", "tokens_per_forward", "waits_chosen",
        "waits_joined", "verify_cut", "drafts_held", "drafter", "cpu_cores",
    ]  # fmt: skip

    # with the ranks' threads recorded: core-hours per million output tokens
    for r in recs:
        for st in r.stages:
            st.threads = 2
    costed = summarize(recs)["pipespec"]
    cores = 2 * len(recs[0].stages)
    assert costed.core_hours_per_million_tokens == pytest.approx(
        cores * costed.wall_s / 3600 / costed.n_tokens * 1e6
    )
    assert costed.gpu_hours_per_million_tokens is None
    # with the cores each rank holds: a model-free stage 0 beside the others holds none
    for r in recs:
        for i, st in enumerate(r.stages):
            st.cores = 0.0 if i == 0 else 1.0
    held = summarize(recs)["pipespec"]
    assert held.core_hours_per_million_tokens == pytest.approx(
        (len(recs[0].stages) - 1) * held.wall_s / 3600 / held.n_tokens * 1e6
    )
    write_summary(tmp_path / "costed.json", {"pipespec": costed})
    assert read_summary(tmp_path / "costed.json")["pipespec"] == costed

    bench = benchmark_table(recs, ["ar", "sd", "pipespec"])
    write_benchmark(tmp_path / "benchmark.json", bench)
    assert read_benchmark(tmp_path / "benchmark.json") == bench
    doc = json.loads((tmp_path / "benchmark.json").read_text())
    assert list(doc) == ["ar", "pipespec"]
    assert list(doc["pipespec"]) == [
        "n_prompts", "n_tokens", "wall_s", "ms_per_token", "tokens_per_s", "mean_accepted_per_verification",
        "busy_fraction", "batch_size", "sequence_ms_per_token", "speedup", "speedup_per_prompt", "method",
    ]  # fmt: skip
    assert (doc["pipespec"]["method"], doc["pipespec"]["batch_size"]) == ("pipespec", 1)
    assert doc["pipespec"]["speedup_per_prompt"] == {"median": 3.0, "min": 2.0, "max": 4.0, "n": 2}
    # without AR there is no speedup: the keys are absent, as before
    no_ar = benchmark_table(recs[2:], ["pipespec"])
    assert "speedup" not in no_ar["pipespec"].to_json()
    write_benchmark(tmp_path / "b2.json", no_ar)
    assert read_benchmark(tmp_path / "b2.json")["pipespec"].speedup is None


def test_summary_json_of_an_older_run_reads(tmp_path: Path) -> None:
    """summary.json without peak_rss_mb (older runs) and without energy (CPU runs) reads; a file
    that is not a summary is a RecordError naming the file."""
    s = summarize([make_record()])["pipespec"].to_json()
    del (
        s["peak_rss_mb"],
        s["energy_j_per_token_system"],
        s["energy_j_per_token_per_gpu"],
        s["n_gpus_measured"],
        s["method"],  # entries named their method and batch size only by their key then
    )
    s4 = {**s, "batch_size": 4}
    (tmp_path / "summary.json").write_text(json.dumps({"pipespec": s, "pipespec@b4": s4}))
    doc = read_summary(tmp_path / "summary.json")
    got = doc["pipespec"]
    assert isinstance(got, MethodSummary) and got.peak_rss_mb == [] and got.n_gpus_measured is None
    assert (got.method, got.batch_size) == ("pipespec", 1)
    assert (doc["pipespec@b4"].method, doc["pipespec@b4"].batch_size) == ("pipespec", 4)
    (tmp_path / "bad.json").write_text(json.dumps({"ar": {"n_prompts": 1}}))
    with pytest.raises(RecordError, match=r"bad\.json: 'ar': missing field 'n_tokens'"):
        read_benchmark(tmp_path / "bad.json")
    (tmp_path / "cut.json").write_text('{"ar": {"n_prompts": 1,')
    with pytest.raises(RecordError, match=r"cut\.json:1: not JSON"):
        read_summary(tmp_path / "cut.json")
    assert isinstance(BenchmarkRow.from_json(json.loads(json.dumps(
        {"n_prompts": 1, "n_tokens": 2, "wall_s": 1, "ms_per_token": 500, "tokens_per_s": 2,
         "mean_accepted_per_verification": {}, "busy_fraction": [1.0]}))), BenchmarkRow)  # fmt: skip


def test_to_json_is_asdict_without_the_copy() -> None:
    """Record.to_json shares the record's lists (json.dumps only reads them) and says exactly what
    dataclasses.asdict says."""
    import dataclasses

    r = make_record("pipespec", "p0", 0.5)
    r.stages[1].timeline = [[0.0, 0.1, "verify", 4, 12]]
    r.stages[0].drafter = {"proposals": {"job": 2}}
    doc = r.to_json()
    assert doc == dataclasses.asdict(r) and json.dumps(doc) == json.dumps(dataclasses.asdict(r))
    assert doc["stages"][1]["timeline"] is r.stages[1].timeline  # shared, not copied
    assert Record.from_json(json.loads(json.dumps(doc))) == r
