"""Stress the cross-host start-up: launch it many times per transport on the multi-host bed
(tests/multihost/netbed.py), optionally beside synthetic CPU load, and report every launch that
hung or failed with each rank's last start-up step.

    .venv/bin/python bench/startup_stress.py --launches 50 --load 4        # gloo, strict, mpi
    .venv/bin/python bench/startup_stress.py --transports gloo --app        # the whole tiny job

Each launch runs 3 ranks, 2 on host 0 and 1 on host 1 (``-n``, ``--ppn``), through the start-up
(by default tests/multihost/startup_probe.py: MPI, the rendezvous, the channels, the epochs window
and the doorbell as run/setup.py opens them, without a model; ``--app``: ``python -m pipespec_mpi
hierarchy=tiny``, the multi-host test's job). A launch still running after ``--timeout`` s counts
as hung: every rank's Python stacks (SIGUSR1, faulthandler) and native stacks (gdb, where
installed) are kept in its directory before it is killed. Needs root (the bed: network namespaces
and a TUN device).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "multihost"))  # the bed: tests/multihost/netbed.py

import netbed  # noqa: E402

PROBE = ROOT / "tests" / "multihost" / "startup_probe.py"  # one rank of a probe launch
STEP = re.compile(r"start-up: (.+?) (\(rank \d+, limit|done in)")
# the multi-host test's job (tests/multihost/test_multihost.py), for --app
APP = ["hierarchy=tiny", "run.mode=benchmark", "decode.lookahead=2", "decode.max_new_tokens=40",
       "dataset.n_prompts=3", "decode.policy=static", "run.progress=false"]  # fmt: skip


@dataclass
class Launch:
    """One launch's outcome: ok, failed (ended non-zero) or hung (still running at the timeout)."""

    transport: str
    index: int
    status: str
    seconds: float
    steps: dict[int, str] = field(default_factory=dict)  # rank -> its last start-up step
    message: str = ""  # the job's pipespec_mpi message, where it printed one
    run_dir: str = ""


# ---- the loop -----------------------------------------------------------------------------------
def rank_pids(run_dir: Path) -> list[int]:
    """The pids of the python processes with ``run_dir`` on their command line (the ranks)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        python = Path(os.fsdecode(argv[0])).name.startswith("python")
        if proc.name.isdigit() and python and any(os.fsencode(run_dir) in a for a in argv):
            pids.append(int(proc.name))
    return pids


def dump_stacks(run_dir: Path) -> None:
    """Each rank's Python stacks (to the launch's stderr) and native stacks (``gdb-<pid>.txt``)."""
    pids = rank_pids(run_dir)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    gdb = shutil.which("gdb")
    for pid in pids if gdb else []:
        with open(run_dir / f"gdb-{pid}.txt", "w") as out:
            subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
                           stdout=out, stderr=subprocess.STDOUT, timeout=120, check=False)  # fmt: skip
    time.sleep(1.0)  # the faulthandler dumps reach the launch's stderr


def last_steps(run_dir: Path) -> dict[int, str]:
    """Each rank's last start-up step from its rank*.log ("... done" once it ended)."""
    steps = {}
    for log in sorted(run_dir.glob("rank*.log")):
        rank = int(log.stem[4:])
        found = STEP.findall(log.read_text(errors="replace"))
        if found:
            name, how = found[-1]
            steps[rank] = f"{name} done" if how == "done in" else name
        else:
            steps[rank] = "(nothing logged: before the first step)"
    return steps


def pipespec_message(text: str) -> str:
    """The first line a rank printed as the job's error (``[pipespec_mpi] ...``), if any."""
    for line in text.splitlines():
        if line.startswith("[pipespec_mpi]") and ("start-up" in line or "error" in line or "FATAL" in line):
            return line.strip()
    return ""


def launch_once(
    bed: netbed.NetBed, args: argparse.Namespace, transport: str, index: int, out: Path
) -> Launch:
    run_dir = out / transport / str(index)
    run_dir.mkdir(parents=True, exist_ok=True)
    over = [f"transport.kind={transport}", f"run.startup_timeout_s={args.startup_timeout}", *args.overrides]
    if args.app:
        command = [sys.executable, "-m", "pipespec_mpi", *APP, *over, f"hydra.run.dir={run_dir}"]
    else:
        command = [sys.executable, str(PROBE), str(run_dir), *over]
    argv = bed.mpirun(args.n, args.ppn, command, hosts=-(-args.n // args.ppn))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    with open(run_dir / "stdout", "w") as so, open(run_dir / "stderr", "w") as se:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=so, stderr=se, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status = "hung"
            dump_stacks(run_dir)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            for pid in rank_pids(run_dir):  # ranks of another host's proxy, outside the group
                os.kill(pid, signal.SIGKILL)
    took = time.monotonic() - t0
    text = (run_dir / "stdout").read_text(errors="replace") + (run_dir / "stderr").read_text(errors="replace")
    return Launch(transport, index, status, round(took, 1), last_steps(run_dir), pipespec_message(text),
                  str(run_dir))  # fmt: skip


def start_load(n: int) -> list[subprocess.Popen]:
    """``n`` processes that each keep one CPU busy (synthetic load beside the launches)."""
    spin = "import itertools\nfor _ in itertools.count(): pass"
    return [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]


def report(launches: list[Launch]) -> str:
    lines = []
    for t in dict.fromkeys(x.transport for x in launches):
        mine = [x for x in launches if x.transport == t]
        ok = [x.seconds for x in mine if x.status == "ok"]
        failed = sum(x.status.startswith("failed") for x in mine)
        hung = sum(x.status == "hung" for x in mine)
        times = f"{statistics.median(ok):.1f} s median, {max(ok):.1f} s max" if ok else "-"
        lines.append(f"{t}: {len(mine)} launches, {len(ok)} ok ({times}), {failed} failed, {hung} hung")
    for x in launches:
        if x.status != "ok":
            steps = "; ".join(f"rank {r}: {s}" for r, s in sorted(x.steps.items()))
            lines.append(f"  {x.transport} #{x.index} {x.status} after {x.seconds} s: {steps}")
            if x.message:
                lines.append(f"    {x.message}")
            lines.append(f"    {x.run_dir}")
    return "\n".join(lines)


def stress(args: argparse.Namespace) -> int:
    why = netbed.problem()
    if why:
        print(f"no multi-host bed here: {why}", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="startup-stress-"))
    bed = netbed.NetBed(netbed.BedConfig(name=args.name, hosts=2, delay_ms=args.delay_ms, net=args.net))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the load and the bed go in ``finally``
    load = start_load(args.load)
    launches: list[Launch] = []
    try:
        bed.up()
        for i in range(args.launches):
            for t in args.transports.split(","):  # interleaved: load and time hit every transport alike
                x = launch_once(bed, args, t, i, out)
                launches.append(x)
                print(f"{t} #{i}: {x.status} in {x.seconds} s" + ("" if x.status == "ok" else f" {x.steps}"),
                      flush=True)  # fmt: skip
    finally:
        for p in load:
            p.kill()
            p.wait()
        bed.down()
        (out / "launches.json").write_text(json.dumps([asdict(x) for x in launches], indent=1))
    print(report(launches))
    print(f"launch directories and launches.json: {out}")
    return 0 if all(x.status == "ok" for x in launches) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/startup_stress.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])  # fmt: skip
    p.add_argument("--transports", default="gloo,strict,mpi", help="comma-separated (default: %(default)s)")
    p.add_argument("--launches", type=int, default=20, help="per transport (default: %(default)s)")
    p.add_argument("--load", type=int, default=0, help="CPU-burning processes beside the launches")
    p.add_argument("--app", action="store_true", help="launch the whole tiny job, not the start-up probe")
    p.add_argument("-n", type=int, default=3, help="ranks per launch (default: %(default)s)")
    p.add_argument("--ppn", type=int, default=2, help="ranks per host (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=180, help="a launch running longer is hung (s)")
    p.add_argument("--startup-timeout", type=float, default=900, help="run.startup_timeout_s of the ranks")
    p.add_argument("--delay-ms", type=float, default=0.2, help="the wire's one-way delay (ms)")
    p.add_argument("--name", default="psstress", help="the bed's name (two loops at once: two names)")
    p.add_argument("--net", type=int, default=93, help="the bed's addresses: 10.NET.0.x")
    p.add_argument("--out", help="where the launches' directories go (default: a new temporary one)")
    p.add_argument("overrides", nargs="*", help="more overrides for every rank (key=value)")
    return stress(p.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
