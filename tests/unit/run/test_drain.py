"""run/drain.py: the stop request a rank checks at its start gate."""

from __future__ import annotations

import os
import signal
import time

from pipespec_mpi.run.drain import STOP_FILE, StopRequest, clear_stale_stop_file


def test_a_stale_stop_file_goes_and_a_fresh_one_stays(tmp_path):
    stop = tmp_path / STOP_FILE
    stop.touch()
    os.utime(stop, (time.time() - 100, time.time() - 100))  # the previous run's request
    clear_stale_stop_file(tmp_path, started=time.time() - 10)
    assert not stop.exists()
    stop.touch()  # written after this run started (the time limit came during start-up)
    clear_stale_stop_file(tmp_path, started=time.time() - 10)
    assert stop.exists()
    clear_stale_stop_file(tmp_path / "nowhere", started=time.time())  # no file: nothing to do


def test_a_stop_is_requested_by_sigusr2_or_the_file(tmp_path):
    stop = StopRequest(tmp_path)
    try:
        assert not stop()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop()
        stop.signalled = False
        (tmp_path / STOP_FILE).touch()
        assert stop()
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def test_the_exit_code_requeues_only_a_stop_that_made_progress():
    from pipespec_mpi.run.drain import EXIT_DRAINED, EXIT_STOPPED_IDLE, exit_code

    assert exit_code(left=0, finished=5) == 0
    assert exit_code(left=3, finished=5) == EXIT_DRAINED == 75
    assert exit_code(left=8, finished=0) == EXIT_STOPPED_IDLE == 76
