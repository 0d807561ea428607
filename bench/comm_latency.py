"""Proposal round trip per transport and the epochs-window read, between two ranks.

    .venv/bin/mpirun -n 2 .venv/bin/python bench/comm_latency.py [--iters 2000]
    .venv/bin/python bench/comm_latency.py --bed 0,0.1,1      # root: across two hosts of the bed

With ``--bed`` the two ranks run on two hosts of the multi-host bed (tests/multihost/netbed.py), once
per added one-way delay, and the windows that work across nodes (push, rma) are also timed the
way a stage sees them: the owner computes 20 ms "forwards" without entering MPI and publishes
after each; the reader reads every 0.1 ms and records what each read costs it and how long after
its publication each version became visible.

Rank 0 sends a proposal message (the real Sender/Receiver, 8 tokens) and rank 1 echoes it back;
the round trip is timed for each transport available here (mpi, gloo; nccl on CUDA). Then rank 1
reads rank 0's window header (shared-memory and RMA windows) in a loop while rank 0 idles or
computes, which is how a stage's loop reads its neighbour.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from pipespec_mpi.comm.bootstrap import init_torch_distributed, world_info
from pipespec_mpi.comm.links import LinkSpec, open_receiver, open_sender
from pipespec_mpi.comm.window import EpochWindow, PushedEpochWindow, SharedEpochWindow
from pipespec_mpi.host.wait import wait_until
from pipespec_mpi.stage.ports import Header


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
    spec = LinkSpec(peer, 8, 32, device)
    snd = open_sender(transport, comm, spec)
    rcv = open_receiver(transport, comm, spec)
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
    win.publish(Header(1, 0, 64, False, 0, False), list(range(64)), 0)
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


def visibility(win, versions: int, forward_ms: float) -> tuple[float, float, float, float] | None:
    """Rank 0 publishes a version after each ``forward_ms`` of computing (no MPI calls inside);
    rank 1 reads every 0.1 ms. Rank 1 returns (mean read cost, p50 / p90 / max delay from a
    publish to its first read), all in ms."""
    comm = MPI.COMM_WORLD
    comm.Barrier()
    if comm.Get_rank() == 0:
        x = np.random.rand(256, 256)
        for v in range(1, versions + 1):
            t_end = time.perf_counter() + forward_ms / 1000
            while time.perf_counter() < t_end:
                x @ x
            win.publish(Header(1, v, 1, False, time.monotonic_ns() // 1000, False), [v], 0)
        comm.recv(source=1)
        comm.Barrier()
        return None
    costs, delays, seen = [], [], 0
    while seen < versions:
        t0 = time.perf_counter()
        h = win.header(0)
        costs.append(time.perf_counter() - t0)
        if h.prompt == 1 and h.epoch > seen:
            delays.append(time.monotonic_ns() // 1000 - h.want)  # the clock is the machine's
            seen = h.epoch
        time.sleep(1e-4)
    comm.send(True, dest=0)
    comm.Barrier()
    d = np.array(delays) / 1000
    return 1000 * float(np.mean(costs)), float(np.median(d)), float(np.percentile(d, 90)), float(d.max())


def on_bed(delays: list[float], iters: int) -> None:
    """Run this benchmark across two hosts of a bed, once per one-way delay."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "multihost"))
    import netbed  # the bed: tests/multihost/netbed.py

    why = netbed.problem()
    if why:
        sys.exit(f"comm_latency --bed: {why}")
    for d in delays:
        print(f"\n== two hosts, {d} ms added one way", flush=True)
        with netbed.NetBed(netbed.BedConfig(name="psbench", hosts=2, delay_ms=d, net=81)) as bed:
            argv = bed.mpirun(2, 1, [sys.executable, __file__, "--iters", str(iters)])
            subprocess.run(argv, check=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--bed", help="comma-separated one-way delays in ms: run across two bed hosts")
    args = ap.parse_args()
    if args.bed:
        on_bed([float(d) for d in args.bed.split(",")], args.iters)
        return
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
    windows = {} if world.n_nodes > 1 else {"shared": SharedEpochWindow(node, 128, world.rank)}
    windows["rma"] = EpochWindow(comm, 128)
    windows["push"] = PushedEpochWindow(comm, 128, [1 - world.rank], [1 - world.rank])
    reads, seen = {}, {}
    for kind, win in windows.items():
        reads[f"{kind} window, owner idle"] = window_reads(
            win, args.iters // (10 if kind == "rma" else 1), False
        )
        reads[f"{kind} window, owner computing"] = window_reads(
            win, 20 if kind == "rma" else args.iters, True
        )
        seen[kind] = visibility(win, 30, 20.0)
    for win in windows.values():
        win.free()
    node.Free()
    if world.rank == 0:
        print(f"hosts: {world.n_nodes}", flush=True)
        for k, v in res.items():
            print(f"proposal round trip, {k:>4}: {1e6 * v:9.1f} us", flush=True)
    comm.Barrier()
    if world.rank == 1:
        for k, v in reads.items():
            print(f"header read, {k:<32}: {1e6 * v:9.1f} us")
        print("owner computing 20 ms forwards, publishing after each; reader every 0.1 ms:")
        print(f"{'window':<8} {'read cost ms':>12} {'visible p50 ms':>14} {'p90':>6} {'max':>6}")
        for kind, (cost, p50, p90, mx) in seen.items():
            print(f"{kind:<8} {cost:12.3f} {p50:14.3f} {p90:6.3f} {mx:6.3f}", flush=True)


if __name__ == "__main__":
    main()
