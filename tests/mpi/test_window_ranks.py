"""The three epochs windows between real ranks (a pipeline of all of them): every rank publishes
a run of versions, growing, rolling back and rewriting its tokens, while its neighbours read it.
Each read must be one of the owner's versions, whole (tokens matching the header), never older
than the last one read; after the owner's last publish the reader sees it.

The test launches this file under mpirun; as a script it is one rank of that run:
    mpirun -n 3 python tests/mpi/test_window_ranks.py shared|rma|push
"""

from __future__ import annotations

import sys
import time

import pytest

pytestmark = [pytest.mark.mpi]

N_VERSIONS, MAX_TOKENS = 120, 64


def tokens_of(rank: int, v: int) -> list[int]:
    """Version v of a rank's committed tokens: growing by 0-2, every 9th version rolls back 3."""
    n = 0
    for k in range(1, v + 1):
        n = max(0, n - 3) if k % 9 == 0 else min(MAX_TOKENS, n + k % 3)
    first = v // 9 * 9  # tokens rewritten from the last rollback on carry its number
    return [1000 * rank + (first if i >= max(0, n - 2) else 0) + i for i in range(n)]


def rank_main(kind: str) -> None:
    from mpi4py import MPI

    from pipespec_mpi.comm.bootstrap import world_info
    from pipespec_mpi.comm.window import EpochWindow, PushedEpochWindow, SharedEpochWindow
    from pipespec_mpi.stage.ports import Header

    world = world_info()
    comm, r, size = MPI.COMM_WORLD, world.rank, world.size
    up, down = (r - 1 if r > 0 else None), (r + 1 if r < size - 1 else None)
    neighbours = [x for x in (up, down) if x is not None]
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=r)
    if kind == "shared":
        win = SharedEpochWindow(node, MAX_TOKENS, r)
    elif kind == "rma":
        win = EpochWindow(comm, MAX_TOKENS)
    else:
        win = PushedEpochWindow(comm, MAX_TOKENS, neighbours, neighbours, header_only=[down] if down else [])
    comm.Barrier()
    last_seen = dict.fromkeys(neighbours, -1)
    prev: list[int] = []
    for v in range(N_VERSIONS + 1):
        toks = tokens_of(r, v)
        dirty = next((i for i, (a, b) in enumerate(zip(prev, toks)) if a != b), min(len(prev), len(toks)))
        header = Header(1, v, len(toks), False, v, v % 2 == 1, down_epoch=2 * v, down_length=3 * v)
        win.publish(header, toks, dirty)
        prev = toks
        if down is not None:  # the upstream reads its downstream's tokens
            h, theirs = win.snapshot(down)
            if h.prompt == 1:
                assert h.epoch >= last_seen[down], (h.epoch, last_seen[down])
                assert theirs == tokens_of(down, h.epoch), (kind, r, h.epoch)
                assert h.length == len(theirs) and h.want == h.epoch and h.idle == (h.epoch % 2 == 1)
                assert (h.down_epoch, h.down_length) == (2 * h.epoch, 3 * h.epoch)
                last_seen[down] = h.epoch
        if up is not None:  # the downstream reads its upstream's header
            h = win.header(up)
            if h.prompt == 1:
                assert h.epoch >= last_seen[up] and h.length == len(tokens_of(up, h.epoch))
                last_seen[up] = h.epoch
        time.sleep(0.0005 * ((r + v) % 3))
    comm.Barrier()
    for x in neighbours:  # after everyone's last publish, the newest version arrives
        deadline = time.monotonic() + 10
        while win.header(x).epoch != N_VERSIONS:
            assert time.monotonic() < deadline, f"{kind}: rank {r} never saw rank {x}'s last version"
            time.sleep(0.001)
    if down is not None:
        h, theirs = win.snapshot(down)
        assert theirs == tokens_of(down, N_VERSIONS)
    assert all(win.heartbeat_age_s(x) < 60 for x in range(size)) or kind == "shared"
    comm.Barrier()
    win.free()
    node.Free()
    if r == 0:
        print(f"window ok: {kind} over {size} ranks", flush=True)


@pytest.mark.parametrize("kind,n", [("shared", 3), ("rma", 3), ("push", 2), ("push", 3), ("push", 4)])
def test_window_between_ranks(kind, n):
    from conftest import run_ranks

    assert f"window ok: {kind} over {n} ranks" in run_ranks(__file__, n, [kind])


if __name__ == "__main__":
    try:
        rank_main(sys.argv[1])
    except BaseException:
        import traceback

        from mpi4py import MPI

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)  # one failing rank ends the run instead of leaving the others waiting
