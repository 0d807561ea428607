"""Operations under real mpirun: sharding over replicas, user datasets, resume after a kill,
failures that never hang, and bad input that fails before any heavy work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import MPIRUN, ROOT, launch, launch_ok

pytestmark = [pytest.mark.mpi, pytest.mark.slow]
TINY = ["hierarchy=tiny", "dataset=synthetic", "decode.max_new_tokens=24"]


# long tier (CI's 30 minutes): CI's replicas run under Slurm (tests/slurm: two replicas in one job)
@pytest.mark.long
def test_two_replicas_give_the_same_prompts_and_outputs_as_one(tmp_path):
    one = launch_ok(3, [*TINY, "dataset.n_prompts=5"], tmp_path / "one")
    two = launch_ok(6, [*TINY, "dataset.n_prompts=5"], tmp_path / "two")
    assert {r.replica for r in two} == {0, 1}
    as_map = lambda rs: {r.prompt_id: r.output_ids for r in rs}  # noqa: E731
    assert as_map(one) == as_map(two) and len(as_map(one)) == 5


def test_jsonl_dataset(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "def add(a, b):", "id": "add"}\n\n{"prompt": "Once upon a time"}\n')
    recs = launch_ok(
        3,
        ["hierarchy=tiny", "dataset=jsonl", f"dataset.path={data}", "decode.max_new_tokens=8"],
        tmp_path / "run",
    )
    assert sorted(r.prompt_id for r in recs) == ["1", "add"]
    first = next(r for r in recs if r.prompt_id == "add")
    assert first.prompt_ids == [256, *b"def add(a, b):"]


def _run_bg(overrides, run_dir, env=None):
    cmd = [str(MPIRUN), "-n", "3", sys.executable, "-m", "pipespec_mpi", *overrides,
           "run.progress=false", f"hydra.run.dir={run_dir}"]  # fmt: skip
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def test_resume_after_kill_gives_the_uninterrupted_results(tmp_path):
    args = [*TINY, "dataset.n_prompts=6", "decode.max_new_tokens=200", "method=pipespec"]
    full = {r.prompt_id: r.output_ids for r in launch_ok(3, args, tmp_path / "full")}
    run_dir = tmp_path / "killed"
    proc = _run_bg([*args, "dataset.round_rows=4"], run_dir)  # the kill comes in the first round
    part = run_dir / "parts" / "replica-0.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and (not part.exists() or len(part.read_text().splitlines()) < 2):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # like a node lost or a time limit hit
    proc.wait(timeout=30)
    done_before = len(part.read_text().splitlines())
    assert 2 <= done_before < 6, "the kill came too late to test resuming"
    with open(part, "a") as f:  # as if the kill had come in the middle of writing a record
        f.write('{"prompt_id": "torn", "replica": 0, "meth')
    resumed = launch_ok(3, [*args, "run.resume=true", "dataset.round_rows=2"], run_dir)  # over rounds
    got = {r.prompt_id: r.output_ids for r in resumed}
    assert got == full
    assert len(resumed) == 6  # each prompt once: the finished ones were skipped, not redone
    assert "torn" not in part.read_text()  # cut before the resumed run appended


@pytest.mark.parametrize("fault", ["raise@1", "kill@2", "hang@0"])
def test_a_failing_rank_ends_the_job_quickly(tmp_path, fault):
    t0 = time.time()
    proc = launch(3, [*TINY, "dataset.n_prompts=4", "run.stall_timeout_s=8"], tmp_path,
                  timeout=120, env={"PIPESPEC_INJECT_FAULT": fault})  # fmt: skip
    elapsed = time.time() - t0
    assert proc.returncode != 0
    assert elapsed < 90, f"took {elapsed:.0f} s"
    out = proc.stdout + proc.stderr
    logs = "".join(f"\n--- {p.name}\n{p.read_text()}" for p in sorted(tmp_path.glob("rank*.log")))
    why = f"exit {proc.returncode}\n{out}{logs}"
    if fault.startswith("raise"):
        assert "FATAL on rank 1" in out and "InjectedFault" in out, why
        assert "InjectedFault" in (tmp_path / "rank1.log").read_text(), why  # kept in its log too
    elif fault.startswith("hang"):
        assert "no progress" in out, why
        assert "rank 0 (stage 0, tiny-draft-1L) stopped answering" in out, why
    else:
        assert "KILLED" in out or "signal 9" in out.lower() or "BAD TERMINATION" in out, why


@pytest.mark.parametrize(
    "n,overrides,needle",
    [
        (4, ["hierarchy=tiny"], "world size 4 is not a multiple of the hierarchy's 3 stages"),
        pytest.param(
            3,
            ["hierarchy=tiny", "decode.lookahead=-2", "decode.max_new_tokens=999999"],
            "decode.lookahead=-2",
            marks=pytest.mark.long,
        ),
        pytest.param(3, ["hierarchy=tiny", "+run.typo_key=1"], "typo_key", marks=pytest.mark.long),
        pytest.param(
            3,
            ["hierarchy=tiny", "dataset=jsonl", "dataset.path=/nonexistent.jsonl"],
            "no such file",
            marks=pytest.mark.long,
        ),
        (3, ["hierarchy=tiny", "dataset=synthetic", "decode.max_new_tokens=4090"], "context of 4096"),
        (2, ["hierarchy=llama3_8b_70b", "hierarchy.stages.1.quantization=none"], "not available offline"),
        (2, ["hierarchy=llama3_8b_70b"], "bitsandbytes) needs CUDA"),  # a GPU-only setting on this CPU node
        (
            3,
            ["hierarchy=tiny", "hierarchy.choose=true", "auto.replicas=2"],
            "auto.replicas=2 does not divide",
        ),
        pytest.param(
            3,
            ["hierarchy=tiny", "hierarchy.choose=true", "auto.margin=-1"],
            "auto.margin=-1",
            marks=pytest.mark.long,
        ),
    ],
)
def test_bad_input_fails_fast_with_one_clear_error(tmp_path, n, overrides, needle):
    t0 = time.time()
    proc = launch(n, overrides, tmp_path, timeout=120)
    assert proc.returncode != 0
    assert needle in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.time() - t0 < 60


def test_empty_dataset_is_an_error(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    proc = launch(3, ["hierarchy=tiny", "dataset=jsonl", f"dataset.path={empty}"], tmp_path / "r")
    assert proc.returncode != 0 and "has no rows" in proc.stderr


def test_mismatched_tokenizers_are_refused(tmp_path):
    conf = tmp_path / "conf" / "hierarchy"
    conf.mkdir(parents=True)
    (conf / "mixed.yaml").write_text(json.dumps({
        "name": "mixed", "tokenizer": {"kind": "smollm2"},
        "stages": [{"name": "tiny-draft", "kind": "tiny", "layers": 1, "dtype": "float64"},
                   {"name": "smollm2", "kind": "smollm2"}],
    }))  # fmt: skip
    proc = launch(2, ["--config-dir", str(tmp_path / "conf"), "hierarchy=mixed"], tmp_path / "r")
    assert proc.returncode != 0
    assert "do not share one tokenizer" in proc.stderr and "tiny-draft" in proc.stderr
