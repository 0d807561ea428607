"""``pipespec-report``: the table on hand-made records with known answers, the PNGs,
and (marked mpi) the whole path from a real mpirun run and a real Hydra multirun sweep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipespec_mpi.analysis import report

PNG = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[3]
MPIRUN = Path(sys.executable).parent / "mpirun"
MODELS = ["d-1L", "m-3L", "t-4L"]


# --------------------------------------------------------------------------------------------
# hand-made run dirs


def _stage(s: int, model: str, trace: list, wall: float, last: bool, tokens: int) -> dict:
    verifs = len(trace)
    return {
        "stage": s, "rank": s, "model": model, "forward_calls": verifs + 1, "draft_steps": 0,
        "own_steps": 0, "verifications": verifs, "tokens_proposed": 0,
        "tokens_verified": sum(n for n, _ in trace), "tokens_accepted": sum(a for _, a in trace),
        "rollbacks": 0, "rollbacks_signalled": 0, "tokens_discarded": 0, "discarded_s": 0.0,
        "dropped_messages": 0, "busy_s": wall / 4, "wait_s": wall / 4, "prefill_s": wall / 4,
        "verify_trace": trace,
        "timeline": [[0.0, wall / 4, "prefill", 5, 5], [wall / 4, wall / 2, "wait", 0, 5],
                     [wall / 2, wall, "verify" if trace else "own", 1, 6]],
        "commit_times": [[wall / 2, tokens // 2], [wall, tokens]] if last else [],
    }  # fmt: skip


def rec(method: str, prompt: str, wall: float, tokens: int, traces=None, *, lookahead=2,
        warmup=False, models=MODELS, max_new=32) -> dict:  # fmt: skip
    traces = traces or [[] for _ in models]
    n = len(models)
    return {
        "prompt_id": prompt, "replica": 0, "method": method, "warmup": warmup, "seq": 0,
        "prompt_ids": [1, 2], "output_ids": [3] * tokens, "text": "", "n_new_tokens": tokens,
        "finish_reason": "length", "wall_s": wall, "ms_per_token": 1000 * wall / tokens,
        "ttft_s": wall / 2, "window": lookahead, "max_new_tokens": max_new, "transport": "mpi",
        "hierarchy": "h", "models": list(models),
        "stages": [_stage(s, models[s], traces[s], wall, s == n - 1, tokens) for s in range(n)],
    }  # fmt: skip


def write_run(path: Path, records: list[dict], overrides: list[str] | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if overrides is not None:
        (path / ".hydra").mkdir()
        (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        (path / ".hydra" / "config.yaml").write_text("dataset:\n  name: synthetic\n")
    return path


PS_TRACES = [[], [[2, 2], [2, 0]], [[3, 3], [3, 1]]]  # mean accepted 1.0 (0->1), 2.0 (1->2)


def run_a() -> list[dict]:
    """AR 100 ms/token, pipespec 50 ms/token (speedup 2), plus a slow warm-up to be ignored."""
    return [
        rec("ar", "p0", 100.0, 10, warmup=True),
        rec("ar", "p0", 1.0, 10),
        rec("pipespec", "p0", 0.5, 10, PS_TRACES),
        rec("ar", "p1", 1.0, 10),
        rec("pipespec", "p1", 0.5, 10, PS_TRACES),
    ]


def run_b() -> list[dict]:
    """pipespec only, lookahead 4: 25 ms/token (speedup 4 against run A's AR)."""
    return [rec("pipespec", p, 0.25, 10, PS_TRACES, lookahead=4) for p in ("p0", "p1")]


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """A fake multirun dir: 0 = run A, 1 = run B, 2 = a failed job without results."""
    multi = tmp_path / "multirun" / "12-00-00"
    write_run(multi / "0", run_a(), ["decode.lookahead=2"])
    write_run(multi / "1", run_b(), ["method=pipespec", "decode.lookahead=4"])
    (multi / "2").mkdir()
    (multi / "multirun.yaml").write_text("hydra: {}\n")
    return multi


def by_key(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["run"], r["method"]): r for r in rows}


def test_table_known_answers(sweep: Path) -> None:
    runs = report.find_runs([sweep])
    assert [r.path.name for r in runs] == ["0", "1"]
    assert [r.label for r in runs] == ["12-00-00/0", "12-00-00/1"]
    assert runs[1].overrides == ["method=pipespec", "decode.lookahead=4"]
    rows = report.table_rows(runs)
    assert [(r["method"], r["window"]) for r in rows] == [("ar", None), ("pipespec", 2),
                                                             ("pipespec", 4)]  # fmt: skip
    t = by_key(rows)
    ar, ps, ps4 = t["12-00-00/0", "ar"], t["12-00-00/0", "pipespec"], t["12-00-00/1", "pipespec"]
    assert ar["n_prompts"] == 2 and ar["n_tokens"] == 20  # the warm-up record is skipped
    assert ar["ms_per_token"] == pytest.approx(100.0)
    assert ar["tokens_per_s"] == pytest.approx(10.0)
    assert ar["speedup"] == pytest.approx(1.0) and ar["speedup_ref"] == "same run"
    assert ar["models"] == ["t-4L"] and ar["mean_accepted_per_verification"]["0->1"] is None
    assert ps["ms_per_token"] == pytest.approx(50.0) and ps["speedup"] == pytest.approx(2.0)
    assert ps["speedup_ref"] == "same run"
    assert ps["speedup_per_prompt"]["median"] == pytest.approx(2.0)
    assert ps["mean_accepted_per_verification"] == {"0->1": 1.0, "1->2": 2.0}
    assert ps["verifications"] == {"0->1": 4, "1->2": 4}
    assert ps["acceptance_rate"]["1->2"] == pytest.approx(8 / 12)
    assert ps["busy_fraction"] == pytest.approx([0.5, 0.5, 0.5])
    assert ps4["speedup"] == pytest.approx(4.0) and ps4["speedup_ref"] == ["12-00-00/0"]

    text = report.format_table(rows)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["run", "method", "models", "window"]
    assert "d-1L > m-3L > t-4L" in text
    assert "4.00*" in text and "2.00" in text and "0->1 1.00, 1->2 2.00" in text
    md = report.format_table(rows, md=True)
    assert md.startswith("| run | method |") and md.count("| pipespec |") == 2


def test_ar_reference_rules(tmp_path: Path) -> None:
    """Same run first; else other runs over the same workload, pooled; another target: none."""
    a = write_run(tmp_path / "a", [rec("ar", "p0", 1.0, 10), rec("ar", "p1", 3.0, 10)])
    other = write_run(tmp_path / "other", [rec("ar", "q9", 10.0, 10)])  # other prompts: not used
    b = write_run(tmp_path / "b", [rec("sd", p, 1.0, 10, PS_TRACES) for p in ("p0", "p1")])
    c = write_run(tmp_path / "c", [rec("pipespec", "p0", 1.0, 10, models=["d", "t2"])])
    rows = report.table_rows(report.find_runs([a, other, b, c]))
    t = by_key(rows)
    assert t["b", "sd"]["speedup"] == pytest.approx(2.0)  # pooled AR: 4 s / 20 tokens
    assert t["b", "sd"]["speedup_ref"] == ["a"]
    assert t["c", "pipespec"]["speedup"] is None and t["c", "pipespec"]["speedup_ref"] is None
    assert t["c", "pipespec"]["mean_accepted_per_verification"] == {"0->1": None}
    assert "- no AR run of that target" in report.format_table(rows)
    # without a same-workload candidate every AR run of the target is pooled: 14 s / 30 tokens
    other2 = write_run(tmp_path / "other2", [rec("ar", "q8", 4.0, 20)])
    rows = report.table_rows(report.find_runs([other, other2, b]))
    assert by_key(rows)["b", "sd"]["speedup"] == pytest.approx((14 / 30) / (2 / 20))


def test_find_runs_order_and_errors(tmp_path: Path) -> None:
    multi = tmp_path / "m"
    for n in (10, 2, 1):
        write_run(multi / str(n), [rec("ar", "p0", 1.0, 10)])
    assert [r.path.name for r in report.find_runs([multi])] == ["1", "2", "10"]
    with pytest.raises(report.ReportError, match="no such directory"):
        report.find_runs([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(report.ReportError, match="no results.jsonl"):
        report.find_runs([tmp_path / "empty"])
    assert report.main([str(tmp_path / "empty")]) == 2


def test_sweep_detection_and_cross_dir(sweep: Path, tmp_path: Path) -> None:
    runs = report.find_runs([sweep])
    rows = report.table_rows(runs)
    sweeps = report.lookahead_sweeps(rows)
    assert list(sweeps) == ["pipespec (d-1L > m-3L > t-4L)"]
    assert [r["window"] for r in sweeps["pipespec (d-1L > m-3L > t-4L)"]] == [2, 4]
    assert report.lookahead_sweeps(rows[:2]) == {}
    assert report.ar_ms_per_token(runs) == {"t-4L": pytest.approx(100.0)}
    assert report.cross_run_dir(runs) == sweep.resolve()
    assert report.cross_run_dir(runs[:1]) is None
    assert report.cross_run_dir(runs[:1], tmp_path / "x") == tmp_path / "x"


def test_timeline_records_picks_a_prompt_every_method_decoded(tmp_path: Path) -> None:
    d = write_run(tmp_path / "r", [rec("pipespec", "p0", 1.0, 10, PS_TRACES), *run_a()[1:]])
    (run,) = report.find_runs([d])
    got = report.timeline_records(run)
    assert list(got) == ["ar", "pipespec"] and {r.prompt_id for r in got.values()} == {"p0"}
    assert got["pipespec"].wall_s == 1.0  # the first record of that prompt and method
    assert {r.prompt_id for r in report.timeline_records(run, "p1").values()} == {"p1"}


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG and path.stat().st_size > 5000


def test_main_writes_table_json_and_pngs(sweep: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    assert report.main([str(sweep)]) == 0
    out = capsys.readouterr()
    assert "ms/token" in out.out and "12-00-00/1: " in out.out and "[decode.lookahead=2]" in out.out
    for name in ("accepted_hist.png", "timeline.png", "busy_fraction.png"):
        assert _is_png(sweep / "0" / name), name
        assert _is_png(sweep / "1" / name), name
    assert _is_png(sweep / "busy_fraction.png")
    assert _is_png(sweep / "speedup_vs_lookahead.png")
    assert "wrote" in out.err

    assert report.main(["--json", "--no-plots", str(sweep / "1")]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["speedup"] is None and rows[0]["window"] == 4


def test_batched_rows_compare_with_ar_at_their_batch_size_and_plot_against_it(tmp_path: Path) -> None:
    """A batch sweep: one row per (method, batch size); a batched phase's time is its span, the
    speedup is over AR at the same batch size; tokens_per_s_vs_batch.png is drawn."""

    def batched(method, prompt, t0, wall, b):
        r = rec(method, prompt, wall, 10)
        r["batch_size"] = b
        r["stages"][-1]["t0_perf_counter"] = t0
        return r

    recs = [
        rec("ar", "a", 1.0, 10),
        rec("ar", "b", 1.0, 10),
        rec("pipespec", "a", 0.5, 10),
        rec("pipespec", "b", 0.5, 10),
        batched("ar", "a", 10.0, 1.0, 2),
        batched("ar", "b", 10.0, 1.0, 2),  # 20 tokens in 1 s
        batched("pipespec", "a", 20.0, 0.8, 2),
        batched("pipespec", "b", 20.2, 0.6, 2),
    ]  # in 0.8 s
    run = write_run(tmp_path / "r", recs)  # fmt: skip
    rows = report.table_rows(report.find_runs([run]))
    got = {(r["method"], r["batch_size"]): r for r in rows}
    assert list(got) == [("ar", 1), ("ar", 2), ("pipespec", 1), ("pipespec", 2)]
    assert got[("ar", 2)]["tokens_per_s"] == pytest.approx(20.0)
    assert got[("pipespec", 1)]["speedup"] == pytest.approx(2.0)
    assert got[("pipespec", 2)]["speedup"] == pytest.approx(1.0 / 0.8)
    assert set(report.batch_sweeps(rows)) == {"ar (t-4L)", "pipespec (d-1L > m-3L > t-4L)"}
    written = report.write_plots(report.find_runs([run]), rows)
    png = run / "tokens_per_s_vs_batch.png"
    assert png in written and png.read_bytes().startswith(PNG)
    assert " batch " in report.format_table(rows, md=True).splitlines()[0]


def test_ar_only_run_has_no_histogram(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    d = write_run(tmp_path / "ar", [rec("ar", "p0", 1.0, 10)])
    assert report.main(["--no-plots", str(d)]) == 0
    assert report.main([str(d)]) == 0
    assert not (d / "accepted_hist.png").exists()
    assert _is_png(d / "timeline.png") and _is_png(d / "busy_fraction.png")


# --------------------------------------------------------------------------------------------
# real runs


def _mpirun(args: list[str], timeout: float = 150) -> None:
    cmd = [str(MPIRUN), "-n", "3", sys.executable, "-m", "pipespec_mpi", *args,
           "hierarchy=tiny", "dataset=synthetic", "run.progress=false"]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"mpirun timed out after {timeout} s: {' '.join(cmd)}\n{err.stderr}")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.mpi
def test_report_on_a_real_benchmark_run(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "bench"
    _mpirun(["run.mode=benchmark", "decode.lookahead=2", "dataset.n_prompts=1", "decode.max_new_tokens=16",
             f"hydra.run.dir={run_dir}"])  # fmt: skip
    assert report.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "tiny-draft-1L > tiny-mid-3L > tiny-target-4L" in out
    assert report.main(["--json", "--no-plots", str(run_dir)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in rows] == ["ar", "sd", "pipespec"]
    assert all(r["n_prompts"] == 1 and r["n_tokens"] == 16 for r in rows)  # warm-up skipped
    assert rows[0]["speedup"] == pytest.approx(1.0)
    assert all(r["speedup"] > 0 and r["speedup_ref"] == "same run" for r in rows)
    assert rows[1]["verifications"]["1->2"] > 0
    for name in ("accepted_hist.png", "timeline.png", "busy_fraction.png"):
        assert _is_png(run_dir / name), name


@pytest.mark.mpi
def test_report_on_a_real_multirun_sweep(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    multi = tmp_path / "multirun"
    _mpirun(["-m", "method=ar,pipespec", "decode.lookahead=1,2", "dataset.n_prompts=1",
             "decode.max_new_tokens=16", f"hydra.sweep.dir={multi}"], timeout=200)  # fmt: skip
    assert report.main(["--json", str(multi)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted((r["method"], r["window"]) for r in rows) == [
        ("ar", None), ("ar", None), ("pipespec", 1), ("pipespec", 2)
    ]  # fmt: skip
    ps = [r for r in rows if r["method"] == "pipespec"]
    assert all(r["speedup"] > 0 and r["speedup_ref"] == ["multirun/0", "multirun/1"] for r in ps)
    for n in range(4):
        assert _is_png(multi / str(n) / "timeline.png")
    assert _is_png(multi / "speedup_vs_lookahead.png")
    assert _is_png(multi / "busy_fraction.png")
