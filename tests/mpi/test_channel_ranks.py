"""Proposal channels between two real ranks, over mpi, gloo and strict (NCCL's rules): chunked
runs arrive whole and in order (with their distributions when sampling) while the receiver polls
late, and both ends close.

The test launches this file under mpirun; as a script it is one rank of that run:
    mpirun -n 2 python tests/mpi/test_channel_ranks.py mpi|gloo
"""

from __future__ import annotations

import sys
import time

import pytest

pytestmark = [pytest.mark.mpi]

N_RUNS, DEPTH, WIDTH, VOCAB = 60, 3, 4, 5


def runs():
    """(prompt, epoch, start, tokens) of each send, lengths 1..11 (up to 3 messages each)."""
    return [(k // 20, k % 3, 7 * k, list(range(100 * k, 100 * k + 1 + k % 11))) for k in range(N_RUNS)]


def rows(k: int, n: int):
    import numpy as np

    return np.random.default_rng(k).random((n, VOCAB), dtype=np.float32)


def send_side(transport: str, comm, dist_width: int, wait) -> None:
    from pipespec_mpi.comm.links import LinkSpec, open_sender
    from pipespec_mpi.host.wait import Backoff

    snd = open_sender(transport, comm, LinkSpec(1, DEPTH, WIDTH, None, dist_width))
    backoff = Backoff()
    for k, (prompt, epoch, start, tokens) in enumerate(runs()):
        dists = rows(k, len(tokens)) if dist_width else None
        done = 0
        while done < len(tokens):  # never blocks: retry the rest after a pause
            rest = None if dists is None else dists[done:]
            n = snd.try_send(prompt, epoch, start + done, tokens[done:], rest)
            done += n
            if not n:
                backoff.sleep()
    assert snd.bytes_sent > 0
    snd.close(wait)


def receive_side(transport: str, comm, dist_width: int, wait) -> None:
    import numpy as np

    from pipespec_mpi.comm.links import LinkSpec, open_receiver

    rcv = open_receiver(transport, comm, LinkSpec(0, DEPTH, WIDTH, None, dist_width))
    time.sleep(0.3)  # polls late: the sender gets ahead of the posted receives
    got = []
    expected = runs()
    n_tokens = sum(len(r[3]) for r in expected)

    def arrived() -> bool:
        got.extend(rcv.poll())
        return sum(len(p.tokens) for p in got) >= n_tokens

    wait(arrived, "every proposal")
    flat = [(p.prompt, p.epoch, p.start + j, t) for p in got for j, t in enumerate(p.tokens)]
    assert flat == [(pr, ep, st + j, t) for pr, ep, st, toks in expected for j, t in enumerate(toks)]
    assert all(1 <= len(p.tokens) <= WIDTH for p in got)
    if dist_width:
        sent = np.concatenate([rows(k, len(r[3])) for k, r in enumerate(expected)])
        assert np.array_equal(np.concatenate([p.dists for p in got]), sent)
    else:
        assert all(p.dists is None for p in got)
    rcv.close(wait)
    assert rcv.closed == DEPTH and rcv.poll() == []


def rank_main(transport: str) -> None:
    from mpi4py import MPI

    from pipespec_mpi.comm.bootstrap import init_torch_distributed, shutdown_torch_distributed, world_info
    from pipespec_mpi.host.wait import wait_until

    world = world_info()
    comm = MPI.COMM_WORLD
    if transport in ("gloo", "strict"):
        init_torch_distributed(world, "gloo", None)
    if transport == "strict":  # NCCL's rules over gloo: the link's communicator
        from pipespec_mpi.comm.strict import StrictP2P

        comm = StrictP2P(world.rank)

    def wait(cond, what):
        wait_until(cond, 30, what)

    for dist_width in (0, VOCAB):
        side = send_side if world.rank == 0 else receive_side
        side(transport, comm, dist_width, wait)
        MPI.COMM_WORLD.Barrier()
    if transport in ("gloo", "strict"):
        shutdown_torch_distributed()
    if world.rank == 1:
        print(f"channel ok over {transport}", flush=True)


@pytest.mark.parametrize("transport", ["mpi", "gloo", "strict"])
def test_channel_between_two_ranks(transport):
    from conftest import run_ranks

    assert f"channel ok over {transport}" in run_ranks(__file__, 2, [transport])


if __name__ == "__main__":
    rank_main(sys.argv[1])
