"""Doorbells between real ranks (host/doorbell.py, run/setup.py ``open_doorbell``): on one node
every neighbour's hello arrives, so a bell covers its rank where the window and transport let a
ring mean a visible change; and a small MPI message is in the receiver's queue by the time the
ring it was followed by wakes the receiver (what ``bell_covers`` relies on for proposals); every
rank of the replica hears every other's hello, so joining a job's collective rings the others,
and a rank waiting at a deal sleeps up to ``QUIET_S`` between polls instead of polling every
millisecond, and is dealt as soon as the last stage claims.

The test launches this file under mpirun; as a script it is one rank of that run:
    mpirun -n 3 python tests/mpi/test_doorbell_ranks.py
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.mpi]

ROUNDS = 300


def rank_main() -> None:
    from dataclasses import replace
    from types import SimpleNamespace

    import numpy as np

    from pipespec_mpi.comm.bootstrap import world_info
    from pipespec_mpi.config.load import compose_config
    from pipespec_mpi.config.schema import Transport
    from pipespec_mpi.platforms import current_platform
    from pipespec_mpi.run.setup import open_doorbell, window_kind
    from pipespec_mpi.topology import place

    world = world_info()
    comm = world.comm
    pl = place(world.rank, world.size, 3)

    def cfg(*overrides: str):
        return compose_config(["hierarchy=tiny", *overrides])

    covers = {}
    for name, overrides, transport, sampled in (
        ("mpi", [], "mpi", False),
        ("gloo", [], "gloo", False),
        ("leviathan", ["sampling.temperature=1.0"], "mpi", True),
        ("push", ["run.epochs_window=push"], "mpi", False),
    ):
        c = cfg(*overrides)
        seam = replace(current_platform().resolve(c, world), transport=Transport(transport))
        loaded = SimpleNamespace(seam=seam, sampled=sampled)
        bell = open_doorbell(c, world, pl, loaded, window_kind(c.run.epochs_window, world.hosts, 3))
        covers[name] = bell.covers
        if name == "mpi":
            kept = bell
        else:
            bell.close()
    assert covers == {"mpi": True, "gloo": False, "leviathan": False, "push": False}, covers
    off = cfg("run.doorbell=false")
    seam = current_platform().resolve(off, world)
    assert seam.waits == "poll"
    assert open_doorbell(off, world, pl, SimpleNamespace(seam=seam, sampled=False), "shared") is None

    # rank 0 sends a small message, then rings rank 1: rank 1, woken, finds it at its first test
    buf = np.zeros(40, dtype=np.int64)
    late = 0
    for k in range(ROUNDS):
        if world.rank == 0:
            buf[:] = k
            req = comm.Isend(buf, dest=1, tag=5)
            kept.ring(1)
            req.Wait()
        elif world.rank == 1:
            req = comm.Irecv(buf, source=0, tag=5)
            while not kept.wait(10.0):
                pass
            if not req.Test():
                late += 1
                req.Wait()
            assert int(buf[0]) == k
        comm.Barrier()
    # a deal over the replica: ranks 0 and 1 wait while rank 2 (the last stage) has not claimed
    from pipespec_mpi.run.collect import VoteDeal
    from pipespec_mpi.run.drive import drive
    from pipespec_mpi.stage.deal import JobQueue
    from pipespec_mpi.stage.loop import Step
    from pipespec_mpi.stage.prompt import On, Wait

    peers = pl.peers
    assert peers == [r for r in range(3) if r != world.rank], peers
    assert kept.heard == set(peers) and kept.collectives

    class CountingBell:
        covers = collectives = True

        def __init__(self, bell):
            self.bell, self.waits = bell, 0

        def wait(self, timeout_s: float) -> bool:
            self.waits += 1
            return self.bell.wait(timeout_s)

    class AtTheDeal:
        def __init__(self, deal):
            self.deal, self.got = deal, None

        def step(self):
            self.got = self.deal.dealt()
            return Step.WAITING if self.got is None else Step.DONE

        def wait(self):
            return Wait(On.COLLECTIVE)

        def describe(self):
            return "at the deal"

    import time

    from pipespec_mpi.host.doorbell import RingingDeal

    counting = CountingBell(kept)
    claim_after = 0.5
    deal = RingingDeal(VoteDeal(comm, JobQueue(3) if world.rank == 2 else None), kept, peers)
    if world.rank == 2:
        time.sleep(claim_after)  # the last stage still decodes its job
    deal.open()
    waiter = AtTheDeal(deal)
    drive(waiter, stall_timeout_s=30, bell=counting)
    assert waiter.got == 0, waiter.got
    if world.rank != 2:  # polled every ms, it would have woken ~500 times
        assert counting.waits < claim_after / 0.01 + 40, counting.waits
    waits = comm.gather(counting.waits)
    kept.close()
    if world.rank == 1:
        print(f"doorbell ok: {late} of {ROUNDS} messages not there when rung", flush=True)
    if world.rank == 0:
        print(f"deal ok: wake-ups per rank {waits}", flush=True)


def test_doorbells_between_three_ranks():
    from conftest import run_ranks

    out = run_ranks(__file__, 3, [])
    assert "doorbell ok: 0 of" in out and "deal ok" in out, out


if __name__ == "__main__":
    rank_main()
