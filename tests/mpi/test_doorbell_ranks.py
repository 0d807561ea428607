"""Doorbells between real ranks (comm/doorbell.py, run/setup.py ``open_doorbell``): on one node
every neighbour's hello arrives, so a bell covers its rank where the window and transport let a
ring mean a visible change; and a small MPI message is in the receiver's queue by the time the
ring it was followed by wakes the receiver (what ``bell_covers`` relies on for proposals).

The test launches this file under mpirun; as a script it is one rank of that run:
    mpirun -n 3 python tests/mpi/test_doorbell_ranks.py
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.mpi]

ROUNDS = 300


def rank_main() -> None:
    from types import SimpleNamespace

    import numpy as np

    from pipespec_mpi.comm.bootstrap import world_info
    from pipespec_mpi.config.load import compose_config
    from pipespec_mpi.run.setup import open_doorbell
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
        loaded = SimpleNamespace(transport=transport, sampled=sampled)
        bell = open_doorbell(cfg(*overrides), world, pl, loaded)
        covers[name] = bell.covers
        if name == "mpi":
            kept = bell
        else:
            bell.close()
    assert covers == {"mpi": True, "gloo": False, "leviathan": False, "push": False}, covers
    off = SimpleNamespace(transport="mpi", sampled=False)
    assert open_doorbell(cfg("run.doorbell=false"), world, pl, off) is None

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
    kept.close()
    if world.rank == 1:
        print(f"doorbell ok: {late} of {ROUNDS} messages not there when rung", flush=True)


def test_doorbells_between_three_ranks():
    from conftest import run_ranks

    out = run_ranks(__file__, 3, [])
    assert "doorbell ok: 0 of" in out, out


if __name__ == "__main__":
    rank_main()
