"""Proposal round trip per transport and the epochs-window read, between two ranks.

    .venv/bin/mpirun -n 2 .venv/bin/python bench/comm_latency.py [--iters 2000]

Rank 0 sends a proposal message (the real Sender/Receiver, 8 tokens) and rank 1 echoes it back;
the round trip is timed for each transport available here (mpi, gloo; nccl on CUDA). Then rank 1
reads rank 0's window header (shared-memory and RMA windows) in a loop while rank 0 idles or
computes, which is how a stage's loop reads its neighbour.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from pipespec_mpi.comm.bootstrap import init_torch_distributed, world_info
from pipespec_mpi.comm.channel import open_receiver, open_sender
from pipespec_mpi.comm.wait import wait_until
from pipespec_mpi.comm.window import EpochWindow, SharedEpochWindow


def wait(cond, what):
    wait_until(cond, 30, what)


def send(snd, start: int, toks: list[int]) -> None:
    """Post every token: ``try_send`` posts what free send buffers allow, the rest is retried."""
    done = 0

    def all_posted() -> bool:
        nonlocal done
        done += snd.try_send(1, 0, start + done, toks[done:])
        return done == len(toks)

    wait(all_posted, "free send buffers")


def round_trip(transport: str, iters: int) -> float | None:
    comm = MPI.COMM_WORLD
    r = comm.Get_rank()
    peer = 1 - r
    device = None
    if transport == "nccl":
        import torch

        device = torch.device(f"cuda:{r}")
    snd = open_sender(transport, comm, peer, 8, 32, device)
    rcv = open_receiver(transport, comm, peer, 8, 32, device)
    toks = list(range(8))
    comm.Barrier()
    t0 = time.perf_counter()
    for i in range(iters):
        if r == 0:
            send(snd, i, toks)
            got: list = []
            while not got:
                got = rcv.poll()
        else:
            got = []
            while not got:
                got = rcv.poll()
            send(snd, i, toks)
    dt = (time.perf_counter() - t0) / iters
    snd.close(wait)
    rcv.close(wait)
    comm.Barrier()
    return dt


def window_reads(win, iters: int, busy: bool) -> float | None:
    comm = MPI.COMM_WORLD
    r = comm.Get_rank()
    win.publish(prompt=1, epoch=0, tokens=list(range(64)), dirty_from=0)
    comm.Barrier()
    result = None
    if r == 1:
        t0 = time.perf_counter()
        for _ in range(iters):
            win.header(0)
        result = (time.perf_counter() - t0) / iters
        comm.send(True, dest=0)
    else:
        req = comm.irecv(source=1)
        x = np.random.rand(512, 512)
        while not req.Test():
            if busy:
                x @ x  # a long computation without MPI calls, like a forward
            else:
                time.sleep(1e-4)
    comm.Barrier()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    world = world_info()
    comm = MPI.COMM_WORLD
    assert world.size == 2, "run with mpirun -n 2"
    res = {"mpi": round_trip("mpi", args.iters)}
    import torch

    if torch.cuda.device_count() >= 2:  # NCCL needs a GPU per rank
        torch.cuda.set_device(world.rank)
        init_torch_distributed(world, "nccl", None)
        res["nccl"] = round_trip("nccl", args.iters // 4)
    else:
        init_torch_distributed(world, "gloo", None)
        res["gloo"] = round_trip("gloo", args.iters // 4)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    shared = SharedEpochWindow(node, 128, world.rank)
    rma = EpochWindow(comm, 128)
    reads = {
        "shared window, owner idle": window_reads(shared, args.iters, False),
        "shared window, owner computing": window_reads(shared, args.iters, True),
        "rma window, owner idle": window_reads(rma, args.iters // 10, False),
        "rma window, owner computing": window_reads(rma, 20, True),
    }
    shared.free()
    rma.free()
    node.Free()
    if world.rank == 0:
        for k, v in res.items():
            print(f"proposal round trip, {k:>4}: {1e6 * v:9.1f} us")
    if world.rank == 1:
        for k, v in reads.items():
            print(f"header read, {k:<32}: {1e6 * v:9.1f} us")


if __name__ == "__main__":
    main()
