"""The strict transport (comm/strict.py) refuses what NCCL would refuse or silently break on, where
gloo, underneath it, forgives it: two ranks entering a pair's operations in different orders, a
send buffer written before its send completed, a message read before its receive completed, a
tag, a pair's first operation without the peer's, and a message smaller than its receive.

The test launches this file under mpirun; as a script it is one rank of that run:
    mpirun -n 2 python tests/mpi/test_strict_ranks.py gloo|strict CASE
and prints ``CASE: ok`` or ``CASE: StrictError: ...`` on each rank.
"""

from __future__ import annotations

import sys
import time

import pytest

pytestmark = [pytest.mark.mpi]

CASES = ("order", "reuse", "early_read", "tag", "alone", "size")


class Plain:
    """gloo's own point-to-point operations, as the transports' strict ones are called."""

    rank = 0

    def isend(self, buf, peer, tag):
        import torch.distributed as dist

        return _Done(dist.isend(buf, dst=peer, tag=tag))

    def irecv(self, buf, peer, tag):
        import torch.distributed as dist

        return _Done(dist.irecv(buf, src=peer, tag=tag))


class _Done:
    def __init__(self, work) -> None:
        self.work = work

    def is_completed(self) -> bool:
        self.work.wait()
        return True


def finish(*ops) -> None:
    deadline = time.monotonic() + 30
    pending = list(ops)
    while pending:
        pending = [op for op in pending if not op.is_completed()]
        if time.monotonic() > deadline:
            raise TimeoutError("operations did not complete")
        time.sleep(0.001)


def run_case(case: str, p2p, rank: int) -> None:
    import torch

    from pipespec_mpi.comm.strict import check_read
    from pipespec_mpi.comm.wire import TAG, slot_tag

    peer = 1 - rank
    out, into = torch.arange(8, dtype=torch.int64) + 10 * rank, torch.zeros(8, dtype=torch.int64)
    if case == "order":  # both ranks send first, then receive: NCCL's one stream per pair deadlocks
        s = p2p.isend(out, peer, TAG)
        r = p2p.irecv(into, peer, TAG)
        finish(r, s)
        assert into[0] == 10 * peer
    elif case == "reuse":  # the sender writes its buffer before the send completed
        if rank == 0:
            s = p2p.isend(out, peer, TAG)
            out[0] = 99
            finish(s)
        else:
            finish(p2p.irecv(into, peer, TAG))
    elif case == "early_read":  # the receiver reads the message before its receive completed
        if rank == 0:
            time.sleep(0.5)
            finish(p2p.isend(out, peer, TAG))
        else:
            r = p2p.irecv(into, peer, TAG)
            if isinstance(p2p, Plain):
                _ = int(into[0])  # gloo: whatever the buffer held
            else:
                check_read(into, peer, rank)  # what the strict receiver does before it decodes
            finish(r)
    elif case == "tag":  # a second link on the pair, told apart by its tag
        if rank == 0:
            finish(p2p.isend(out, peer, slot_tag(1)))
        else:
            finish(p2p.irecv(into, peer, slot_tag(1)))
    elif case == "size":  # a message smaller than the receive it meets
        if rank == 0:
            finish(p2p.isend(out[:6], peer, TAG))
        else:
            finish(p2p.irecv(into, peer, TAG))
    elif case == "alone":  # rank 1 enters an operation on the pair, rank 0 never does
        if rank == 1:
            finish(p2p.irecv(into, peer, TAG))
        else:
            time.sleep(4)
    else:
        raise ValueError(case)


def rank_main(transport: str, case: str) -> None:
    from mpi4py import MPI

    from pipespec_mpi.comm.bootstrap import init_torch_distributed, world_info
    from pipespec_mpi.comm.strict import StrictError, StrictP2P

    world = world_info()
    init_torch_distributed(world, "gloo", None)
    p2p = StrictP2P(world.rank, timeout_s=2.0) if transport == "strict" else Plain()
    try:
        run_case(case, p2p, world.rank)
        verdict = "ok"
    except (StrictError, TimeoutError) as err:
        verdict = f"{type(err).__name__}: {err}"
    print(f"rank {world.rank} {case}: {verdict}", flush=True)
    sys.stdout.flush()
    MPI.COMM_WORLD.Barrier()
    if case in ("alone", "order") and transport == "strict":
        import os

        os._exit(0)  # gloo works the strict checks left pending: no graceful teardown


@pytest.mark.parametrize("case", CASES)
def test_gloo_forgives_what_strict_refuses(case):
    from conftest import run_ranks

    if case != "alone":  # gloo never notices a peer that does not come: it waits
        gloo = run_ranks(__file__, 2, ["gloo", case], timeout=120)
        assert gloo.count(f"{case}: ok") == 2, gloo
    strict = run_ranks(__file__, 2, ["strict", case], timeout=120)
    want = {
        "order": "entered their pair's operations in different orders",
        "reuse": "was written before its send completed",
        "early_read": "was read before its receive completed",
        "tag": "NCCL has no tags",
        "alone": "waited 2 s for the peer's",
        "size": "sent 6 words (operation 0 of the pair) into rank 1's receive of 8",
    }[case]
    assert want in strict, strict


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])
