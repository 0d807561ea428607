"""The start-up watchdog's per-phase limit (run/startup.py): the rendezvous' steps have their own."""

from __future__ import annotations

import threading

from pipespec_mpi.run.startup import StartupWatchdog


def test_a_phase_with_its_own_limit_is_ended_by_it_naming_its_setting():
    fired: list[str] = []
    done = threading.Event()
    wd = StartupWatchdog(
        900, rank=2, hosts=["n0", "n0", "n1"], on_timeout=lambda m: (fired.append(m), done.set())
    )
    with wd.phase("rendezvous (gloo): check-in", 0.2, "transport.rendezvous_timeout_s"):
        assert done.wait(10)
    wd.close()
    assert (
        "'rendezvous (gloo): check-in' did not end within 0.2 s (transport.rendezvous_timeout_s)" in fired[0]
    )
    assert "rank 2 (n1)" in fired[0] and "a peer may have died or be stuck" in fired[0]
