"""The user's rows (data/requests.py), their preparation (run/jobs.py), the output formats
(run/outputs.py), the start-up watchdog (run/startup.py) and the progress line (run/collect.py)."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest
from hydra.errors import ConfigCompositionException

from pipespec_mpi.config import SamplingConfig, compose_config, validate
from pipespec_mpi.data.datasets import load_prompts
from pipespec_mpi.data.requests import BadRow, DatasetError, Request, RowSettings, read_requests
from pipespec_mpi.models.tokenizer import ByteTokenizer
from pipespec_mpi.run.jobs import Job, Prompt, check_rows, prepare, sampler_for, tokenize_prompts

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
ROWS = [
    {"prompt": "plain one", "id": "a", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 7,
     "seed": 3},
    {"messages": CHAT},
    {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": CHAT, "max_completion_tokens": 6}},
    {"custom_id": "d", "url": "/v1/completions", "body": {"prompt": "complete me", "max_tokens": 4}},
]  # fmt: skip


def write_jsonl(path, rows, extra_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


def cfg_for(path, *over):
    return compose_config(["hierarchy=tiny", "dataset=files", f"dataset.path={path}", *over])


def test_every_row_kind_is_read_in_file_order_with_its_settings(tmp_path):
    cfg = cfg_for(write_jsonl(tmp_path / "rows.jsonl", ROWS, extra_lines=["", "{oops"]))
    got = list(read_requests(cfg.dataset))
    a, b, c, d, bad = got
    assert a == Request("a", 0, text="plain one", settings=RowSettings(5, 0.5, 0.9, 7, 3),
                        source=f"{tmp_path / 'rows.jsonl'}:1")  # fmt: skip
    assert b.id == "1" and b.messages == (("system", "be brief"), ("user", "hello")) and b.chat
    assert c.id == "c" and c.openai and c.chat and c.settings.max_tokens == 6
    assert d.id == "d" and d.openai and not d.chat and d.text == "complete me"
    assert isinstance(bad, BadRow) and bad.position == 4 and bad.source.endswith(":6")  # blank line skipped
    assert "not JSON" in bad.reason


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"id": 1}, "needs a string field 'prompt'"),
        ({"prompt": "x", "messages": CHAT}, "give one"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens=0: must be >= 1"),
        ({"prompt": "x", "max_tokens": 2.5}, "must be an integer"),
        ({"prompt": "x", "temperature": -1}, "temperature=-1"),
        ({"prompt": "x", "top_p": 0}, "top_p=0"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role 'wizard'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text content"),
        ({"custom_id": "z", "body": {"messages": CHAT, "n": 2}}, "one completion per request"),
        ({"custom_id": "z", "url": "/v1/embeddings", "body": {}}, "can be answered"),
        ("just a string", "must be an object"),
    ],
)
def test_a_row_that_is_not_a_request_says_why(tmp_path, row, reason):
    cfg = cfg_for(write_jsonl(tmp_path / "r.jsonl", [row]))
    (got,) = read_requests(cfg.dataset)
    assert isinstance(got, BadRow) and reason in got.reason, got


def test_renamed_fields_and_a_folder_of_jsonl_and_parquet_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", [{"question": "q0", "key": "k0"}])
    table = pa.Table.from_pylist([{"question": f"q{i}", "key": f"k{i}", "max_tokens": i} for i in (1, 2)])
    pq.write_table(table, folder / "b.parquet")
    (folder / "notes.txt").write_text("ignored")
    cfg = cfg_for(folder, "dataset.prompt_field=question", "dataset.id_field=key")
    got = list(read_requests(cfg.dataset))
    assert [(r.id, r.position, r.text, r.settings.max_tokens) for r in got] == [
        ("k0", 0, "q0", None), ("k1", 1, "q1", 1), ("k2", 2, "q2", 2)
    ]  # fmt: skip
    assert got[2].source.endswith("b.parquet#1")


def test_parquet_chat_messages_are_read_as_turns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"id": "m", "messages": CHAT}]), tmp_path / "chat.parquet")
    (got,) = read_requests(cfg_for(tmp_path / "chat.parquet").dataset)
    assert got.messages == (("system", "be brief"), ("user", "hello"))


def test_a_parquet_table_of_mixed_rows_reads_its_nulls_as_absent(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"prompt": "plain", "custom_id": None, "body": None, "max_tokens": None, "max_completion_tokens": 3},
        {"prompt": None, "custom_id": "c1", "body": {"messages": CHAT, "max_tokens": 4}},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "mixed.parquet")
    plain, chat = read_requests(cfg_for(tmp_path / "mixed.parquet").dataset)
    assert plain.text == "plain" and not plain.openai and plain.settings.max_tokens == 3
    assert chat.id == "c1" and chat.openai and chat.settings.max_tokens == 4


def test_user_files_are_all_rows_in_order_unless_asked(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": f"p{i}"} for i in range(30)])
    assert [r.id for r in load_prompts(cfg_for(path).dataset)] == [str(i) for i in range(30)]
    assert len(load_prompts(cfg_for(path, "dataset.n_prompts=4").dataset)) == 4
    # shuffled: a seeded choice of rows (decoded in file order: results are in row order anyway)
    some = cfg_for(path, "dataset.shuffle=true", "dataset.n_prompts=5").dataset
    chosen = [r.id for r in load_prompts(some)]
    assert chosen == sorted(chosen, key=int) and chosen != [str(i) for i in range(5)] and len(chosen) == 5


def test_dataset_config_errors_are_named():
    for override in ("dataset.truncate=middle", "dataset.file_format=csv", "run.on_error=ignore",
                     "run.output_format=xml"):  # fmt: skip
        with pytest.raises(ConfigCompositionException, match=override):  # refused by its type
            compose_config(["hierarchy=tiny", "dataset=files", "dataset.path=x", override])
    cfg = compose_config(["hierarchy=tiny", "dataset=files", "dataset.path=x"])
    cfg.dataset = replace(cfg.dataset, truncate="middle", file_format="csv", n_prompts=0)
    cfg.run = replace(cfg.run, on_error="ignore", output_format="xml")
    text = " ".join(validate(cfg))
    for key in ("dataset.truncate='middle'", "dataset.file_format='csv'", "dataset.n_prompts=0",
                "run.on_error='ignore'", "run.output_format='xml'"):  # fmt: skip
        assert key in text
    with pytest.raises(DatasetError, match="no such file"):
        load_prompts(cfg_for("/nonexistent/rows.jsonl").dataset)


def test_preparing_a_row_tokenizes_cuts_only_when_asked_and_checks_its_budget(tmp_path):
    tok = ByteTokenizer()
    long = Request("L", 0, text="x" * 20)
    cfg = cfg_for("unused", "dataset.max_prompt_tokens=8", "decode.max_new_tokens=10")
    bad = prepare(long, cfg, tok)
    assert isinstance(bad, BadRow) and "21 tokens, more than dataset.max_prompt_tokens=8" in bad.reason
    left = prepare(long, cfg_for("u", "dataset.max_prompt_tokens=8", "dataset.truncate=left"), tok)
    assert left.ids == [ByteTokenizer.BOS] + [ord("x")] * 7 and left.truncated == 13
    right = prepare(Request("R", 0, text="abcdefghij"), cfg_for("u", "dataset.max_prompt_tokens=4",
                    "dataset.truncate=right"), tok)  # fmt: skip
    assert right.ids == [ByteTokenizer.BOS, *b"abc"] and right.truncated == 7
    over = prepare(Request("o", 3, text="hi", settings=RowSettings(max_tokens=11)), cfg, tok)
    assert isinstance(over, BadRow) and "decode.max_new_tokens=10" in over.reason and over.position == 3
    assert "empty" in prepare(Request("e", 0, text="  "), cfg, tok).reason
    chat = prepare(Request("c", 0, messages=(("user", "hi"),)), cfg_for("u"), tok)
    assert chat.chat and chat.ids == tok.encode("user: hi\nassistant:")


def test_duplicate_ids_and_bad_rows_are_kept_apart_in_row_order(tmp_path):
    path = write_jsonl(
        tmp_path / "r.jsonl", [{"prompt": "a", "id": "x"}, {"prompt": ""}, {"prompt": "b", "id": "x"}]
    )
    prepared = tokenize_prompts(cfg_for(path), ByteTokenizer())
    assert [p.id for p in prepared.prompts] == ["x"]
    assert [(b.position, b.reason.split(" (")[0]) for b in prepared.bad] == [
        (1, "empty prompt"),
        (2, "duplicate id"),
    ]
    with pytest.raises(DatasetError, match="row 1 .*empty prompt; 2 bad row"):
        check_rows(len(prepared.prompts), prepared.bad, "fail")
    check_rows(len(prepared.prompts), prepared.bad, "skip")  # skip: the job goes on
    with pytest.raises(DatasetError, match="none of the 2 rows"):
        check_rows(0, prepared.bad, "skip")


def test_a_rows_sampling_settings_replace_the_jobs():
    cfg = compose_config(["hierarchy=tiny", "sampling.temperature=0.3", "sampling.seed=9"])
    plain = Job(1, Prompt("p", [1], 0), "pipespec", warmup=False)
    own = Job(1, Prompt("p", [1], 0, RowSettings(temperature=0.0, top_k=5, seed=2)), "pipespec", warmup=False)
    assert sampler_for(cfg, plain).rule == SamplingConfig(temperature=0.3, seed=9)
    rule = sampler_for(cfg, own).rule
    assert (rule.temperature, rule.top_k, rule.seed, rule.top_p) == (0.0, 5, 2, 1.0)
    assert sampler_for(cfg, own).greedy and sampler_for(cfg, own).key != sampler_for(cfg, plain).key


# --------------------------------------------------------------------------------------------
# outputs


def make_record(pid, position, *, request="prompt", sample=0, method="pipespec", text="out"):
    from pipespec_mpi.records import Record
    from pipespec_mpi.stage.stats import StageStats

    stages = [StageStats(0, 0, "d"), StageStats(1, 1, "t", verifications=2, tokens_accepted=3)]
    return Record(prompt_id=pid, replica=0, method=method, warmup=False, sample_idx=sample, seq=1,
                  prompt_ids=[1, 2, 3], output_ids=[5, 6], text=text, n_new_tokens=2, finish_reason="eos",
                  wall_s=0.1, ms_per_token=50.0, ttft_s=0.05, window=0, max_new_tokens=8, transport="mpi",
                  hierarchy="tiny", models=["d", "t"], stages=stages, position=position, request=request,
                  end_time=1.7e9)  # fmt: skip


def test_openai_output_answers_every_row_once_in_row_order(tmp_path):
    from pipespec_mpi.run.finalize import place
    from pipespec_mpi.run.outputs import write_openai

    records = [make_record("b", 2, request="chat", sample=1, text="two"), make_record("a", 0),
               make_record("b", 2, request="chat", sample=0, text="one")]  # fmt: skip
    records.sort(key=place)  # results.jsonl's order, what finalize streams to the writer
    errors = [{"id": None, "position": 1, "source": "f:2", "reason": "empty prompt"}]
    assert write_openai(tmp_path / "o.jsonl", records, errors, "target") == 3
    lines = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["a", "1", "b"]
    a, err, b = lines
    assert a["response"]["status_code"] == 200 and a["error"] is None
    assert a["response"]["body"]["object"] == "text_completion"
    assert a["response"]["body"]["choices"] == [
        {"index": 0, "text": "out", "finish_reason": "stop", "logprobs": None}
    ]
    assert a["response"]["body"]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert a["pipespec"]["accepted_per_verification"] == [{"0->1": 1.5}]
    assert err["response"] is None and err["error"]["message"] == "empty prompt"
    body = b["response"]["body"]
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4
    assert [c["message"]["content"] for c in body["choices"]] == ["one", "two"]  # by sample index


def test_parquet_output_is_read_back_by_pyarrow(tmp_path):
    import pyarrow.parquet as pq

    from pipespec_mpi.run.outputs import write_parquet

    records = [make_record(f"r{i}", i) for i in range(10)]
    assert write_parquet(tmp_path / "r.parquet", records, rows_per_group=4) == 10
    f = pq.ParquetFile(tmp_path / "r.parquet")
    assert f.metadata.num_row_groups == 3
    t = f.read().to_pylist()
    assert [r["id"] for r in t] == [f"r{i}" for i in range(10)]
    assert t[0]["output_ids"] == [5, 6] and t[0]["accepted_per_verification"] == 1.5
    assert t[0]["prompt_tokens"] == 3 and t[0]["finish_reason"] == "eos"


# --------------------------------------------------------------------------------------------
# start-up watchdog, progress


def test_a_phase_that_overruns_is_reported_with_its_name_rank_and_hosts():
    from pipespec_mpi.run.startup import StartupWatchdog

    fired, done = [], threading.Event()

    def on_timeout(msg):
        fired.append(msg)
        done.set()

    wd = StartupWatchdog(0.2, rank=1, hosts=["n0", "n1"], on_timeout=on_timeout)
    with wd.phase("model load (stage 1, mid)"):
        pass  # ends in time: nothing fires
    with wd.phase("rendezvous (gloo)"):
        assert done.wait(5.0)
    wd.close()
    (msg,) = fired
    assert "'rendezvous (gloo)'" in msg and "rank 1 (n1)" in msg and "n0, n1" in msg
    assert "transport.iface" in msg and "run.startup_timeout_s=0.2" in msg


def test_a_phase_that_fails_names_itself_and_keeps_the_cause():
    from pipespec_mpi.run.startup import StartupError, StartupWatchdog

    wd = StartupWatchdog(60, rank=2, hosts=["n0", "n0", "n1"], on_timeout=lambda m: None)
    with pytest.raises(StartupError) as err, wd.phase("rendezvous (gloo)"):
        raise RuntimeError("Unable to find address for: nosuch0")  # gloo, transport.iface=nosuch0
    wd.close()
    msg = str(err.value)
    assert "start-up phase 'rendezvous (gloo)' failed: Unable to find address for: nosuch0" in msg
    assert "on rank 2 (n1)" in msg and "transport.iface" in msg
    assert isinstance(err.value.__cause__, RuntimeError)
    quiet = StartupWatchdog(60, 0, ["n0"], on_timeout=lambda m: None)
    with pytest.raises(DatasetError), quiet.phase("rows"):  # a user error says what to fix: as is
        raise DatasetError("dataset.path='x': no such file or folder")
    quiet.close()


def test_a_phase_ended_in_time_never_fires():
    from pipespec_mpi.run.startup import StartupWatchdog

    fired = []
    wd = StartupWatchdog(0.3, rank=0, hosts=["n0"], on_timeout=fired.append)
    for _ in range(3):
        with wd.phase("tokenizer and rows"):
            pass
    threading.Event().wait(0.5)
    wd.close()
    assert fired == []


def test_progress_lines_give_rows_left_rate_and_eta(caplog):
    from pipespec_mpi.run.collect import Progress

    t = [0.0]
    p = Progress(replica=1, total=4, every_s=10.0, clock=lambda: t[0])
    with caplog.at_level("INFO", logger="pipespec_mpi"):
        t[0] = 5.0
        p.update(50)  # within every_s: no line
        t[0] = 20.0
        p.update(50)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "replica 1: 2/4 prompt runs done, 2 left, 5.0 tokens/s" in line and "ETA 0:00:20" in line


def test_a_shard_decodes_only_its_own_rows_and_shuffles_as_the_rows_would(tmp_path):
    import random

    lines = [json.dumps({"prompt": f"p{i}"}) if i % 2 == 0 else "{not json" for i in range(20)]
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(lines) + "\n")
    mine = load_prompts(cfg_for(path, "dataset.shard_count=2").dataset)  # the odd rows are never decoded
    assert [r.id for r in mine] == [str(i) for i in range(0, 20, 2)]
    other = load_prompts(cfg_for(path, "dataset.shard_count=2", "dataset.shard_index=1").dataset)
    assert all(isinstance(r, BadRow) for r in other) and [r.position for r in other] == list(range(1, 20, 2))
    over = ["dataset.shuffle=true", "dataset.seed=3", "dataset.n_prompts=7", "dataset.shard_count=3"]
    got = [[r.position for r in load_prompts(cfg_for(path, *over, f"dataset.shard_index={i}").dataset)]
           for i in range(3)]  # fmt: skip
    order = list(range(20))
    random.Random(3).shuffle(order)  # what shuffling the rows themselves gives
    assert got == [sorted(order[:7][i::3]) for i in range(3)]
