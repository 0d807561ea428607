"""Stopping a job early without tearing anything: Slurm's time limit, or a user's request.

A stop is requested by SIGUSR2 to a rank (``sbatch --signal=USR2@<s>`` signals every task; the
scripts in slurm/ ask for it, SIGUSR1 stays faulthandler's stack dump) or by a file ``STOP`` in
the run directory (what slurm/pipespec.sbatch writes when the batch shell gets the signal, and
what a user can ``touch``). Each stage looks at its request when it reaches the start gate of its
next prompt, and the replica's stages vote there (``VoteGate``: any one of them stopping stops
them all, so no stage starts a prompt its neighbours will not): the prompts in flight finish and
are written, no new one starts, rank 0 merges what is done, and the job exits with
``EXIT_DRAINED`` when prompts are left. slurm/pipespec.sbatch then requeues the job, which
resumes in the same directory (``run.resume=true``). A run stopped before it finished any prompt
exits with ``EXIT_STOPPED_IDLE`` instead, which the script does not requeue: the signal's lead
time leaves no room for work (a ``--signal=...@300`` on a 5-minute job), and requeueing would
loop until the restart limit.
"""

from __future__ import annotations

import signal
from pathlib import Path

EXIT_DRAINED = 75  # EX_TEMPFAIL: stopped on request with prompts left; rerun with run.resume=true
EXIT_STOPPED_IDLE = 76  # stopped on request before finishing any prompt: do not requeue
STOP_FILE = "STOP"


class StopRequest:
    """Whether this rank has been asked to stop: SIGUSR2 received, or ``<run_dir>/STOP`` exists.
    Installs the signal handler (main thread only), which just sets a flag."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / STOP_FILE
        self.signalled = False
        self._before = signal.signal(signal.SIGUSR2, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signalled = True

    def __call__(self) -> bool:
        return self.signalled or self.path.exists()

    def close(self) -> None:
        signal.signal(signal.SIGUSR2, self._before)


def clear_stale_stop_file(run_dir: Path, started: float) -> None:
    """A resumed run starts without the previous run's request: a ``STOP`` written before this
    process ``started`` (its ``time.time()``) goes; one written since (the time limit already
    near while the job was starting) stays and is obeyed."""
    path = Path(run_dir) / STOP_FILE
    try:
        if path.stat().st_mtime < started:
            path.unlink()
    except FileNotFoundError:
        pass


def exit_code(left: int, finished: int) -> int:
    """The job's exit code from the prompt runs it left unstarted and those it finished."""
    if not left:
        return 0
    return EXIT_DRAINED if finished else EXIT_STOPPED_IDLE
