"""pipespec_mpi on a real (single-node) Slurm: the sbatch scripts, a job array and a submitit sweep.

They need the cluster that ``slurm/local/setup.sh`` sets up (CI runs it before pytest). When Slurm
is installed but not running, the ``slurm`` fixture runs that script (it installs nothing then);
when Slurm is missing or will not start, every test here is skipped with the reason. Every wait
has a timeout, after which the job is cancelled and the test fails with the job's output. (No
conftest.py here: tests/mpi's ``from conftest import`` must keep meaning tests/conftest.py.)

All jobs are submitted at once by one module fixture and run side by side on the local node
(slurm/local/setup.sh); each test then waits for its own job. They run the tiny hierarchy on
two synthetic prompts and check that the ranks formed one MPI world (one rank log per rank,
every stage's statistics in each result, the singleton guard firing under ``--mpi=none``) and
that the results landed in the run directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from user_rows import write_rows

from pipespec_mpi.records import RESULTS, Record, read_records

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm")]

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "slurm" / "local" / "setup.sh"
LOCAL_CLUSTER = "pipespec-local"


def shard_row(status: str, index: int) -> list[str]:
    """The cells of ``shards status``'s row for shard ``index`` (split at spaces)."""
    return next(line.split() for line in status.splitlines() if line.startswith(f"shard-{index} "))


def _node_usable() -> bool:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    states = [s.strip() for s in out.split()]
    return any(
        s.startswith(("idle", "mixed", "allocated", "completing")) and not s.endswith("*") for s in states
    )


def slurm_problem() -> str | None:
    """Why the Slurm tests cannot run here, or None when they can."""
    for tool in ("sbatch", "squeue", "scontrol", "sinfo", "scancel"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: Slurm is not installed (run `bash slurm/local/setup.sh`)"
    if not _node_usable():
        if shutil.which("slurmctld") and os.geteuid() == 0:
            try:
                proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=120)
            except subprocess.TimeoutExpired:
                return "slurm/local/setup.sh did not finish within 120 s"
            if proc.returncode != 0:
                return f"slurm/local/setup.sh failed: {(proc.stdout + proc.stderr)[-800:]}"
        if not _node_usable():
            return "no Slurm node takes jobs (start one with `bash slurm/local/setup.sh`)"
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=10).stdout
    m = re.search(r"^ClusterName\s*=\s*(\S+)", config, re.M)
    cluster = m.group(1) if m else "?"
    if cluster != LOCAL_CLUSTER and os.environ.get("PIPESPEC_SLURM_ANY_CLUSTER") != "1":
        return (
            f"Slurm cluster {cluster!r} is not the local test cluster {LOCAL_CLUSTER!r} "
            "(set PIPESPEC_SLURM_ANY_CLUSTER=1 to submit the test jobs to it anyway)"
        )
    return None


@pytest.fixture(scope="session")
def slurm() -> None:
    problem = slurm_problem()
    if problem:
        pytest.skip(problem)


TERMINAL = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
    "BOOT_FAIL", "DEADLINE",
}  # fmt: skip
# Variables of an enclosing job or MPI launch must not leak into the jobs the tests submit.
_LEAKY = ("SLURM_", "SBATCH_", "SRUN_", "PMI_", "PMIX_", "OMPI_", "MPIR_", "HYDRA_", "PIPESPEC_")


def run(cmd: list[str], timeout: float = 30, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{err.stdout}\n{err.stderr}")


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LEAKY)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------- jobs


@dataclass
class Job:
    """A submitted batch job (or job array) and where its Slurm output goes."""

    job_id: str
    out: str  # --output pattern (%j, %A, %a)
    records: list[dict] = field(default_factory=list)

    def out_files(self) -> list[Path]:
        pattern = self.out.replace("%A", self.job_id).replace("%a", "*").replace("%j", "*")
        return sorted(Path(pattern).parent.glob(Path(pattern).name))

    def output(self) -> str:
        return "\n".join(f"==> {p} <==\n{p.read_text(errors='replace')}" for p in self.out_files())


def sbatch(args: list[str], out: Path, env: dict[str, str] | None = None) -> Job:
    """``sbatch --parsable --output=OUT ARGS`` from the repository root; returns the job."""
    out_pattern = str(out)
    proc = run(
        ["sbatch", "--parsable", f"--output={out_pattern}", *args],
        cwd=ROOT,
        env=env or job_env(),
    )
    assert proc.returncode == 0, f"sbatch {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return Job(proc.stdout.strip().split(";")[0], out_pattern)


def job_records(job_id: str) -> list[dict] | None:
    """One dict per job (array task) from ``scontrol show job -o``; [] once Slurm forgot the job,
    None when scontrol did not answer (a busy controller: ask again)."""
    proc = run(["scontrol", "show", "job", "-o", job_id], timeout=15)
    if proc.returncode != 0:
        return [] if "Invalid job id" in proc.stderr else None
    records = []
    for line in proc.stdout.splitlines():
        rec = {}
        for key in ("JobId", "ArrayTaskId", "JobState", "ExitCode", "Reason"):
            m = re.search(rf"(?:^|\s){key}=(\S+)", line)
            if m:
                rec[key] = m.group(1)
        if rec:
            records.append(rec)
    return records


def wait_job(job: Job, timeout: float) -> list[dict]:
    """Wait until every task of the job ended; on timeout cancel it and fail with its output."""
    deadline = time.monotonic() + timeout
    while True:
        records = job_records(job.job_id)
        if records == []:  # purged (MinJobAge, 300 s here) or never known
            return []
        if records and all(r.get("JobState") in TERMINAL for r in records):
            job.records = records
            return records
        if time.monotonic() > deadline:
            run(["scancel", job.job_id], timeout=15)
            pytest.fail(f"job {job.job_id} not finished after {timeout:.0f} s: {records}\n{job.output()}")
        time.sleep(1.0)


def in_queue(job_id: str) -> bool:
    proc = run(["squeue", "-h", "-j", job_id], timeout=15)
    return proc.returncode == 0 and bool(proc.stdout.strip())


APP = [
    "hierarchy=tiny", "dataset=synthetic", "dataset.n_prompts=2", "decode.max_new_tokens=16",
    "run.progress=false", "run.stall_timeout_s=60",
]  # fmt: skip
# --time: Slurm itself ends a job that hangs; --signal: the scripts' USR2 five minutes before the
# limit would come at once on a five-minute job (which then stops before its first prompt)
SBATCH = ["--time=5", "--signal=B:USR2@30"]
# A job with USR2 110 s before its limit, whose limit the test brings to 60-120 s away once it is
# decoding (scontrol update TimeLimit): Slurm's own time-limit signal then comes within ~40 s
# (it checks every 30 s), mid-run whatever the machine's speed. It stops, requeues (Slurm holds a
# requeued job for cred_expire, 30 s in slurm/local/slurm.conf.in) and resumes. 500 prompts: ~3
# min of decoding with the lean forward on a 2-core EPYC (200 prompts, 87 s, once finished
# before the signal came).
WALLTIME_PROMPTS = 500
WALLTIME_APP = [
    "hierarchy=tiny", "dataset=synthetic", f"dataset.n_prompts={WALLTIME_PROMPTS}",
    "decode.max_new_tokens=128", "run.mode=benchmark", "run.methods=[ar,pipespec]",
    "run.progress=false", "run.stall_timeout_s=60",
]  # fmt: skip
# the user's rows (tests/user_rows.py), answered as OpenAI batch output
USER_APP = [
    "hierarchy=tiny", "dataset=files", "decode.max_new_tokens=12", "run.output_format=openai",
    "run.progress=false", "run.stall_timeout_s=60",
]  # fmt: skip
WAIT_S = 240  # per job; they run side by side, typically all done within 60-100 s
SUBMITIT = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None


class Sweep:
    """The submitit submitter: one plain process that runs a Hydra multirun through Slurm."""

    def __init__(self, sweep_dir: Path, log: Path) -> None:
        self.dir, self.log = sweep_dir, log
        cmd = [sys.executable, "-m", "pipespec_mpi", "-m", "hydra/launcher=submitit_slurm",
               *APP, "decode.lookahead=0,2", f"hydra.sweep.dir={sweep_dir}",
               "hydra.launcher.timeout_min=5"]  # fmt: skip
        with open(log, "w") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=job_env(), stdout=f, stderr=subprocess.STDOUT)

    def job_ids(self) -> list[str]:
        sub = self.dir / ".submitit"
        return sorted(p.name for p in sub.iterdir() if p.name.isdigit()) if sub.exists() else []

    def worker_logs(self) -> str:
        logs = sorted((self.dir / ".submitit").glob("*/*_log.*"))
        return "\n".join(f"==> {p} <==\n{p.read_text(errors='replace')[-1500:]}" for p in logs)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for job_id in self.job_ids():
            run(["scancel", job_id], timeout=15)

    def wait(self, timeout: float) -> int:
        """The submitter's exit code. Without slurmdbd, submitit cannot see a job fail (it asks
        sacct), so a job that left the queue without results ends the wait too."""
        deadline = time.monotonic() + timeout
        gone_since = None
        while self.proc.poll() is None:
            ids = self.job_ids()
            if not ids or any(in_queue(j) for j in ids):
                gone_since = None
            else:
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > 30:
                    self.stop()
                    pytest.fail(
                        f"sweep jobs {ids} ended but the submitter still waits for results:\n"
                        f"{self.log.read_text()[-3000:]}\n{self.worker_logs()}"
                    )
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(
                    f"sweep not finished after {timeout:.0f} s:\n{self.log.read_text()[-3000:]}\n"
                    f"{self.worker_logs()}"
                )
            time.sleep(1.0)
        return self.proc.returncode


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory, request):
    """Submit every job of this module at once; cancel what is left at the end."""
    tmp = tmp_path_factory.mktemp("slurm")
    submitted: dict[str, Job | Sweep] = {}
    try:
        submitted["one"] = sbatch([*SBATCH, "slurm/pipespec.sbatch", *APP], tmp / "one-%j.out")
        submitted["array"] = sbatch(
            [*SBATCH, "--array=0-1", "slurm/pipespec_array.sbatch", *APP],
            tmp / "array-%A_%a.out",
        )
        submitted["lost_shard"] = sbatch(
            [*SBATCH, "--array=0-1", "slurm/pipespec_array.sbatch", *APP, "dataset.n_prompts=3"],
            tmp / "lost-%A_%a.out",
        )
        write_rows(tmp / "rows")
        submitted["user_rows"] = sbatch(
            [
                *SBATCH,
                "--array=0-1",
                "slurm/pipespec_array.sbatch",
                *USER_APP,
                f"dataset.path={tmp / 'rows'}",
            ],
            tmp / "rows-%A_%a.out",
        )
        submitted["replicas"] = sbatch(
            [*SBATCH, "--ntasks-per-node=6", "--gpus-per-node=6", "slurm/pipespec.sbatch", *APP],
            tmp / "replicas-%j.out",
        )
        if request.config.getoption("--long"):  # its test is in the long tier
            submitted["walltime"] = sbatch(
                ["--time=10", "--signal=B:USR2@110", "slurm/pipespec.sbatch", *WALLTIME_APP],
                tmp / "walltime-%j.out",
                env=job_env(PIPESPEC_MAX_RESTARTS="10"),
            )
        submitted["singletons"] = sbatch(
            [*SBATCH, "slurm/pipespec.sbatch", *APP],
            tmp / "singletons-%j.out",
            env=job_env(PIPESPEC_SRUN_MPI="none"),
        )
        if SUBMITIT:
            submitted["sweep"] = Sweep(tmp / "sweep", tmp / "sweep.log")
        yield submitted
    finally:
        for job in submitted.values():
            if isinstance(job, Sweep):
                job.stop()
            elif in_queue(job.job_id):
                run(["scancel", job.job_id], timeout=15)
        with contextlib.suppress(OSError):  # outputs/slurm, when the tests left nothing in it
            (ROOT / "outputs" / "slurm").rmdir()


def check_run_dir(run_dir: Path, n_results: int, n_ranks: int, context: str = "") -> list[Record]:
    """results.jsonl with one line per prompt, each with every stage's statistics, and exactly
    one log per rank: the ranks formed one world of n_ranks (singletons would all be rank 0)."""
    results_path = run_dir / RESULTS
    assert results_path.exists(), f"no {results_path}\n{context}"
    results = read_records(results_path)
    assert len(results) == n_results, f"{len(results)} results in {results_path}\n{context}"
    for r in results:
        assert len(r.stages) == 3 and r.n_new_tokens > 0, r
        assert r.hierarchy == "tiny"
    logs = sorted(p.name for p in run_dir.glob("rank*.log"))
    assert logs == sorted(f"rank{i}.log" for i in range(n_ranks)), f"{logs}\n{context}"
    return results


def assert_completed(job: Job, n_tasks: int = 1) -> None:
    records = wait_job(job, WAIT_S)
    assert len(records) == n_tasks, f"{records}\n{job.output()}"
    for r in records:
        assert r["JobState"] == "COMPLETED" and r["ExitCode"] == "0:0", f"{r}\n{job.output()}"


def test_sbatch_runs_one_pipeline_of_three_ranks(jobs):
    job = jobs["one"]
    assert_completed(job)
    out = job.output()
    assert "on 1 node(s)" in out and "3 tasks" in out, out
    assert "srun --mpi=pmi2" in out, out
    assert out.count("[pipespec_mpi] results in") == 1, out
    run_dir = ROOT / "outputs" / "slurm" / job.job_id
    results = check_run_dir(run_dir, n_results=2, n_ranks=3, context=out)
    assert {r.prompt_id for r in results} == {"synthetic/0", "synthetic/1"}
    (slurm_run,) = json.loads((run_dir / "slurm.json").read_text())  # the job's accounting
    assert slurm_run["job_id"] == job.job_id and slurm_run["n_tasks"] == 3, slurm_run
    assert slurm_run["node_list"] and slurm_run["restart_count"] == 0, slurm_run
    shutil.rmtree(run_dir)


def test_sbatch_runs_two_replicas_in_one_job(jobs):
    job = jobs["replicas"]
    assert_completed(job)
    out = job.output()
    assert "6 tasks" in out, out
    run_dir = ROOT / "outputs" / "slurm" / job.job_id
    results = check_run_dir(run_dir, n_results=2, n_ranks=6, context=out)
    assert sorted(r.replica for r in results) == [0, 1], results  # one prompt per replica
    shutil.rmtree(run_dir)


def test_array_tasks_decode_disjoint_shards(jobs):
    job = jobs["array"]
    assert_completed(job, n_tasks=2)
    out = job.output()
    assert "++dataset.shard_index=0 ++dataset.shard_count=2" in out, out
    assert "++dataset.shard_index=1 ++dataset.shard_count=2" in out, out
    base = ROOT / "outputs" / "slurm" / job.job_id
    ids = []
    for shard in (0, 1):
        results = check_run_dir(base / f"shard-{shard}", n_results=1, n_ranks=3, context=out)
        ids += [r.prompt_id for r in results]
    assert sorted(ids) == ["synthetic/0", "synthetic/1"], ids
    shutil.rmtree(base)


def test_an_unfinished_shard_is_resubmitted_alone_and_the_shards_merge(jobs, tmp_path):
    """A lost array task (its directory gone, as after a node failure): ``shards status`` finds
    it, ``shards resubmit`` reruns only it into the same array directory, ``shards merge`` writes
    one results.jsonl with every prompt."""
    job = jobs["lost_shard"]
    assert_completed(job, n_tasks=2)
    base = ROOT / "outputs" / "slurm" / job.job_id
    shutil.rmtree(base / "shard-1")
    shards = [str(Path(sys.executable).with_name("pipespec-shards"))]  # the console script
    status = run([*shards, "status", str(base)], timeout=60, cwd=ROOT)
    assert status.returncode == 3, status.stdout + status.stderr
    assert shard_row(status.stdout, 1)[:4] == ["shard-1", "0", "1", "not"], status.stdout
    assert "missing: 1" in status.stdout, status.stdout
    out = tmp_path / "again-%A_%a.out"
    proc = run([*shards, "resubmit", str(base), "--", *SBATCH, "--parsable", f"--output={out}"],
               timeout=60, cwd=ROOT, env=job_env())  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--array=1 " in proc.stdout and "PIPESPEC_SHARD_COUNT=2" in proc.stdout, proc.stdout
    again = Job(proc.stdout.strip().splitlines()[-1].split(";")[0], str(out))
    assert_completed(again)
    assert "++dataset.shard_index=1 ++dataset.shard_count=2 run.resume=true" in again.output()
    assert run([*shards, "status", str(base)], timeout=60, cwd=ROOT).returncode == 0
    merged = run([*shards, "merge", str(base)], timeout=60, cwd=ROOT)
    assert merged.returncode == 0, merged.stdout + merged.stderr
    results = read_records(base / RESULTS)
    assert sorted(r.prompt_id for r in results) == ["synthetic/0", "synthetic/1", "synthetic/2"]
    assert json.loads((base / "summary.json").read_text())["online"]["n_prompts"] == 3  # the default method
    shutil.rmtree(base)


def test_an_array_over_the_users_files_answers_every_row_once_after_a_killed_shard(jobs, tmp_path):
    """A 2-task array over a Parquet file and an OpenAI batch JSONL: shard 1 is cut back to what a
    killed task leaves (one record and a torn line in its part, no results.jsonl); ``shards
    status`` counts its bad rows and finds it unfinished, ``resubmit`` reruns it with resume, and
    the merge answers every input row exactly once, in results.openai.jsonl (plain JSON lines) or
    in errors.jsonl."""
    job = jobs["user_rows"]
    assert_completed(job, n_tasks=2)
    base = ROOT / "outputs" / "slurm" / job.job_id
    rows = write_rows(tmp_path / "rows")  # the same rows the array read: what to expect
    shard = base / "shard-1"
    part = shard / "parts" / "replica-0.jsonl"
    first = part.read_text().splitlines()[0]
    part.write_text(first + "\n" + first[: len(first) // 2])
    for name in ("results.jsonl", "results.openai.jsonl", "summary.json"):
        (shard / name).unlink()
    shards = [str(Path(sys.executable).with_name("pipespec-shards"))]  # the console script
    status = run([*shards, "status", str(base)], timeout=60, cwd=ROOT)
    row = shard_row(status.stdout, 1)
    assert status.returncode == 3 and row[1] == "1" and row[3] == "unfinished", status.stdout + status.stderr
    assert row[4] == "1" and "jobs done, 2 bad rows" in status.stdout, status.stdout  # the shard, the array
    out = tmp_path / "again-%A_%a.out"
    proc = run([*shards, "resubmit", str(base), "--", *SBATCH, "--parsable", f"--output={out}"],
               timeout=60, cwd=ROOT, env=job_env())  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    again = Job(proc.stdout.strip().splitlines()[-1].split(";")[0], str(out))
    assert_completed(again)
    merged = run([*shards, "merge", str(base)], timeout=60, cwd=ROOT)
    assert merged.returncode == 0, merged.stdout + merged.stderr
    lines = [json.loads(x) for x in (base / "results.openai.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(rows), lines  # each row once
    answered = [x["custom_id"] for x in lines if x["response"] is not None]
    assert len(answered) == len(rows) - 2
    errors = [json.loads(x) for x in (base / "errors.jsonl").read_text().splitlines()]
    assert sorted(e["id"] or str(e["position"]) for e in errors) == ["9", "req-bad"]
    results = read_records(base / RESULTS)
    assert sorted(r.prompt_id for r in results) == sorted(answered)
    shutil.rmtree(base)


def test_srun_without_pmi_is_refused(jobs):
    """--mpi=none starts three 1-rank worlds; pipespec_mpi must fail loudly, not run three times."""
    job = jobs["singletons"]
    records = wait_job(job, WAIT_S)
    out = job.output()
    assert records and records[0]["JobState"] == "FAILED", f"{records}\n{out}"
    assert "srun --mpi=none" in out, out
    assert "did not form one MPI world" in out, out
    assert "[pipespec_mpi] results in" not in out, out
    shutil.rmtree(ROOT / "outputs" / "slurm" / job.job_id, ignore_errors=True)


@pytest.mark.skipif(
    not SUBMITIT, reason="hydra-submitit-launcher is not installed (pip install it into .venv)"
)
def test_submitit_sweep_runs_each_job_as_one_mpi_world(jobs):
    sweep = jobs["sweep"]
    rc = sweep.wait(WAIT_S)
    context = f"{sweep.log.read_text()[-3000:]}\n{sweep.worker_logs()}"
    assert rc == 0, context
    for num, lookahead in ((0, 0), (1, 2)):
        results = check_run_dir(sweep.dir / str(num), n_results=2, n_ranks=3, context=context)
        assert {r.window for r in results} == {lookahead}, results
    # Three Slurm tasks per sweep job (one per rank), all from one job array.
    task_logs = sorted(p.name for p in (sweep.dir / ".submitit").glob("*_*/*_log.out"))
    assert len(task_logs) == 6, task_logs


@pytest.mark.long
def test_a_job_at_its_time_limit_stops_requeues_and_resumes_to_complete_results(jobs):
    """USR2 before the limit: the job stops after the prompts in flight, exits 75, requeues itself
    and resumes (run.resume=true) in the same directory until every prompt is done; the results
    hold each prompt once per method, whole, and PipeSpec equals AR on each (greedy)."""
    job = jobs["walltime"]
    deadline = time.monotonic() + 900
    ended = 0  # polls in a row that found the job ended: a requeue passes through an ended state
    states = []
    parts = ROOT / "outputs" / "slurm" / job.job_id / "parts"
    phase = "decoding"  # -> limit near -> requeued
    while True:
        records = job_records(job.job_id)
        if phase == "decoding" and sum(p.read_text().count("\n") for p in parts.glob("*.jsonl")) >= 4:
            shown = run(["scontrol", "show", "job", job.job_id], timeout=15).stdout
            h, m, sec = re.search(r"RunTime=(?:\d+-)?(\d+):(\d+):(\d+)", shown).groups()
            limit = (int(h) * 3600 + int(m) * 60 + int(sec)) // 60 + 2  # 60-120 s left
            run(["scontrol", "update", f"JobId={job.job_id}", f"TimeLimit={limit}"], timeout=15)
            phase = "limit near"
        if phase == "limit near" and records and records[0].get("JobState") == "PENDING":
            # requeued: give the resumed run room to finish (starting it at once instead of after
            # Slurm's hold, scontrol update StartTime=now, made the requeued job fail)
            run(["scontrol", "update", f"JobId={job.job_id}", "TimeLimit=10"], timeout=15)
            phase = "requeued"
        if records:
            states.append(records[0].get("JobState"))
        ended = ended + 1 if records and all(r.get("JobState") in TERMINAL for r in records) else 0
        if ended >= 8:
            break
        if time.monotonic() > deadline:
            run(["scancel", job.job_id], timeout=15)
            pytest.fail(f"job {job.job_id} not finished after 900 s: {records}\n{job.output()}")
        time.sleep(1.0)
    out = job.output()
    seen = [x for i, x in enumerate(states) if i == 0 or states[i - 1] != x]
    assert records[0]["JobState"] == "COMPLETED" and records[0]["ExitCode"] == "0:0", (
        f"{records} {seen}\n{out}"
    )
    assert "USR2 at" in out and "requeueing job" in out and "(restart 1)" in out, out
    run_dir = ROOT / "outputs" / "slurm" / job.job_id
    results = read_records(run_dir / RESULTS)
    counted = [r for r in results if not r.warmup]
    keys = [(r.prompt_id, r.method) for r in counted]
    assert len(keys) == len(set(keys)) == 2 * WALLTIME_PROMPTS, len(keys)  # every prompt once per method
    by = {k: r.output_ids for k, r in zip(keys, counted)}
    for pid, method in keys:
        assert len(by[(pid, method)]) == 128
        assert by[(pid, "pipespec")] == by[(pid, "ar")], pid
    runs = json.loads((run_dir / "slurm.json").read_text())
    assert [r["restart_count"] for r in runs] == list(range(len(runs))) and len(runs) >= 2, runs
    shutil.rmtree(run_dir)
