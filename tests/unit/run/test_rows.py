"""A job's rows as a stream (run/rows.py): the first pass's verdict, the deal of each round,
and the sorted merge of records that finalize streams (run/finalize.py ``sorted_lines``)."""

from __future__ import annotations

import json

import pytest

from pipespec_mpi.config import compose_config
from pipespec_mpi.data.requests import BadRow
from pipespec_mpi.models.tokenizer import ByteTokenizer
from pipespec_mpi.records import Record, iter_records
from pipespec_mpi.run.finalize import place, sorted_lines
from pipespec_mpi.run.jobs import Prompt, prepared_rows
from pipespec_mpi.run.rows import RowFeed, deal, first_pass
from pipespec_mpi.topology import place as place_rank

from ..data.test_requests import make_record


def rows_file(tmp_path, n, bad_every=0):
    path = tmp_path / "rows.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            bad = bad_every and i % bad_every == 1
            f.write(("{broken" if bad else json.dumps({"prompt": f"row {i}"})) + "\n")
    return path


def test_the_first_pass_counts_prompts_keeps_bad_rows_and_judges_them(tmp_path):
    cfg = compose_config(["hierarchy=tiny", "dataset=files", f"dataset.path={rows_file(tmp_path, 10, 4)}"])
    scan = first_pass(cfg, prepared_rows(cfg, ByteTokenizer()))
    assert scan.n_prompts == 7 and [b.position for b in scan.bad] == [1, 5, 9] and scan.error is None
    assert not scan.sampled
    assert [scan.share(r, 3) for r in range(3)] == [3, 2, 2]
    strict = compose_config(["hierarchy=tiny", "dataset=files", f"dataset.path={tmp_path / 'rows.jsonl'}",
                             "run.on_error=fail"])  # fmt: skip
    assert "row 1" in str(first_pass(strict, prepared_rows(strict, ByteTokenizer())).error)


def test_a_duplicate_id_is_a_bad_row_naming_the_first(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_text("".join(json.dumps({"id": i, "prompt": "x"}) + "\n" for i in ("a", "b", "a")))
    cfg = compose_config(["hierarchy=tiny", "dataset=files", f"dataset.path={path}"])
    got = list(prepared_rows(cfg, ByteTokenizer()))
    assert [type(g) for g in got] == [Prompt, Prompt, BadRow] and "first at row 0" in got[2].reason


def test_rounds_deal_prompts_as_one_deal_of_the_whole_list_would():
    prompts = [Prompt(str(i), [1], i) for i in range(23)]
    n_replicas, n_stages, round_rows = 3, 2, 4
    got: dict[int, list[str]] = {k: [] for k in range(n_replicas)}
    for start in range(0, len(prompts), round_rows * n_replicas):
        shares = deal(prompts[start : start + round_rows * n_replicas], n_replicas, n_stages)
        assert len(shares) == n_replicas * n_stages
        for rank, share in enumerate(shares):
            assert share == shares[rank - rank % n_stages]  # every stage of a replica: the same
            if rank % n_stages == 0:
                got[rank // n_stages] += [p.id for p in share]
    assert got == {k: [p.id for p in prompts[k::n_replicas]] for k in range(n_replicas)}


class OneRank:
    """A world of one rank (what RowFeed needs of a communicator)."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def scatter(self, shares, root=0):
        return shares[0]


def test_the_feed_reads_a_round_at_a_time_and_skips_bad_rows(tmp_path):
    cfg = compose_config(["hierarchy=tiny", "dataset=files", f"dataset.path={rows_file(tmp_path, 25, 3)}",
                          "dataset.round_rows=4"])  # fmt: skip
    read = []

    def rows():
        for got in prepared_rows(cfg, ByteTokenizer()):
            read.append(got.position)
            yield got

    feed = RowFeed(OneRank(), place_rank(0, 1, 1), cfg.dataset.round_rows, rows())
    first = feed.next()
    assert [p.position for p in first] == [0, 2, 3, 5] and read == [0, 1, 2, 3, 4, 5]  # no more read
    rounds = [first]
    while (got := feed.next()) is not None:
        rounds.append(got)
    assert feed.next() is None and [len(r) for r in rounds] == [4, 4, 4, 4, 1]
    assert [p.position for r in rounds for p in r] == [i for i in range(25) if i % 3 != 1]


@pytest.mark.parametrize("run_len", [3, 1000])
def test_sorted_lines_spill_runs_and_merge_them_stably(tmp_path, run_len):
    recs = []
    for i in range(20):
        r = make_record(f"p{i}", (i * 7) % 5)
        r.seq, r.warmup = i, i in (4, 13)
        recs.append(r)
    lines = list(sorted_lines(iter(recs), place, tmp_path, run_len=run_len))
    got = [Record.from_json(json.loads(line)) for line in lines]
    want = sorted(recs, key=place)
    assert [(r.prompt_id, r.seq) for r in got] == [(r.prompt_id, r.seq) for r in want]
    assert got == want and all(line.endswith("\n") and "\t" not in line for line in lines)
    assert not list(tmp_path.glob(".sort-run-*"))  # the spilled runs are removed


def test_iter_records_skips_only_a_torn_last_line(tmp_path, capsys):
    path = tmp_path / "part.jsonl"
    line = json.dumps(make_record("a", 0).to_json())
    path.write_text(line + "\n" + line[:40])
    assert [r.prompt_id for r in iter_records(path)] == ["a"]
    assert "torn last line" in capsys.readouterr().err
