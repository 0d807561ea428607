"""The generated references (docs/config.md, docs/outputs-fields.md): current, complete, and the
staleness check able to fail."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipespec_mpi.analysis.reference import OUTPUT_TABLES, ROOT, main, render_all, stale
from pipespec_mpi.config import (
    AppConfig,
    AutoConfig,
    DecodeConfig,
    DeviceConfig,
    HierarchyConfig,
    OnlineConfig,
    RunConfig,
    SamplingConfig,
    StageConfig,
    TinyBaseConfig,
    TokenizerConfig,
    TransportConfig,
)
from pipespec_mpi.config.reference import COMMAND, config_nodes, config_reference, field_docs, field_table
from pipespec_mpi.data.config import DatasetConfig
from pipespec_mpi.records import BenchmarkRow, MethodSummary, Record
from pipespec_mpi.stage.stats import StageStats

CONFIG_CLASSES = {
    AppConfig, HierarchyConfig, StageConfig, TokenizerConfig, TinyBaseConfig, DatasetConfig,
    DecodeConfig, TransportConfig, RunConfig, SamplingConfig, AutoConfig, OnlineConfig, DeviceConfig,
}  # fmt: skip


def sections(text: str) -> list[list[str]]:
    """The table rows (first cell, the field's path) of each ``## `` section, in order."""
    out: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            out.append([])
        elif out and line.startswith("| `"):
            out[-1].append(line.split(" | ")[0].removeprefix("| `").removesuffix("`"))
    return out


def cells(text: str, path: str) -> list[str]:
    """The cells of the row of ``path`` (pipes inside cells are escaped)."""
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| `{path}` |"))
    return [c.strip() for c in line.replace("\\|", "\0").strip("|").split("|")]


def test_the_committed_files_are_current():
    bad = stale()
    assert not bad, f"stale: {bad}; regenerate with `{COMMAND}` and commit the result"


def test_each_file_says_it_is_generated_and_how():
    for rel, text in render_all().items():
        assert text.splitlines()[0].startswith("_Generated") and COMMAND in text.splitlines()[0], rel


def test_every_config_field_is_a_row():
    nodes = config_nodes()
    assert {cls for _, cls in nodes} == CONFIG_CLASSES
    rows = sections(config_reference())
    assert len(rows) == len(nodes)
    for (path, cls), got in zip(nodes, rows):
        prefix = f"{path}." if path else ""
        assert got == [prefix + f.name for f in dataclasses.fields(cls)], path
    text = config_reference()
    for path in ("decode.lookahead", "hierarchy.stages[i].threads", "device.kernels", "dataset.n_prompts"):
        assert f"| `{path}` |" in text


def test_every_output_field_is_a_row():
    assert {Record, StageStats, MethodSummary, BenchmarkRow} <= {cls for _, cls in OUTPUT_TABLES}
    rows = sections(render_all()["docs/outputs-fields.md"])
    assert len(rows) == len(OUTPUT_TABLES)
    for (where, cls), got in zip(OUTPUT_TABLES, rows):
        assert got == [f.name for f in dataclasses.fields(cls)], where


def test_types_defaults_and_meanings_come_from_the_source():
    text = config_reference()
    assert cells(text, "decode.lookahead")[1:3] == ["`int`", "`0`"]
    assert "proposals a PipeSpec verifier waits for" in cells(text, "decode.lookahead")[3]
    assert cells(text, "hierarchy.stages[i].threads")[1:3] == ["`int \0 None`", "`null`"]
    assert cells(text, "run.methods")[2] == "`[ar, sd, pipespec]`"
    assert cells(text, "hierarchy.name")[2] == "required"
    assert cells(text, "hierarchy.tiny.seed")[3].startswith("seeds the target's weights")


def test_every_field_has_a_docstring():
    """Each setting and each output field says what it is (its docstring: the reference's meaning)."""
    classes = [cls for _, cls in config_nodes()] + [cls for _, cls in OUTPUT_TABLES]
    missing = [
        f"{cls.__name__}.{name}" for cls in classes for name, doc in field_docs(cls).items() if not doc
    ]
    assert not missing, f"fields without a docstring: {missing}"


def test_docstrings_on_the_real_sources():
    stage = field_docs(StageConfig)
    assert "greedy output is bitwise AR's" in stage["exact_rows"]  # a docstring of several lines
    run = field_docs(RunConfig)
    assert run["on_error"].endswith("skip (errors.jsonl) | fail")
    assert run["epochs_window"].startswith("auto: shared memory")
    assert field_docs(AutoConfig)["stale_factor"].startswith("how far apart")
    assert field_docs(TransportConfig)["op_timeout_s"].startswith("how long a posted")
    stats = field_docs(StageStats)
    assert (
        stats["verify_cut"].startswith("its verifications") and "timeline times" in stats["t0_perf_counter"]
    )


@dataclass
class _Sample:
    """Fields documented and not.

    Not part of the heading."""

    plain: int = 1
    documented: int = 2
    """short"""
    wrapped: str = "x"
    """goes on over
    the next line with ``code``"""
    # a comment is not a docstring
    commented: int = 3  # nor is this
    alone: float = 0.5


def test_docstrings_on_a_sample():
    got = field_docs(_Sample)
    assert got == {
        "plain": "",
        "documented": "short",
        "wrapped": "goes on over the next line with `code`",
        "commented": "",
        "alone": "",
    }
    table = field_table(_Sample)
    assert len(table) == 2 + len(dataclasses.fields(_Sample))
    assert table[2] == "| `plain` | `int` | `1` |  |"


def test_the_staleness_check_fails_on_a_changed_default(monkeypatch, capsys):
    assert main(["--check"]) == 0
    monkeypatch.setattr(DecodeConfig.__dataclass_fields__["lookahead"], "default", 7)
    rendered = render_all()
    assert cells(rendered["docs/config.md"], "decode.lookahead")[2] == "`7`"
    assert stale(ROOT, rendered) == ["docs/config.md"]
    assert main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "docs/config.md is stale" in err and COMMAND in err and "outputs-fields.md" not in err


def test_write_then_check_in_a_fresh_root(tmp_path, capsys):
    assert main(["--check", "--root", str(tmp_path)]) == 1  # missing files are stale
    assert main(["--write", "--root", str(tmp_path)]) == 0
    assert main(["--check", "--root", str(tmp_path)]) == 0
    doc = tmp_path / "docs" / "outputs-fields.md"
    doc.write_text(doc.read_text() + "edited by hand\n")
    capsys.readouterr()
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert "docs/outputs-fields.md is stale" in capsys.readouterr().err
