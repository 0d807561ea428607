"""MPI bootstrap: world facts, torch.distributed initialised from MPI, job-wide abort.

Rank, size and local rank come from mpi4py. torch.distributed is only initialised when a torch
transport is chosen: rank 0 picks the rendezvous address and a free port and broadcasts them.
On a single node the rendezvous binds to loopback (gloo otherwise resolves the host name to an
address it may not be able to use); across nodes it uses the interface the user configures, or
the one on the network every host shares (``pick_interface``).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from pipespec_mpi.errors import UserError


@dataclass(frozen=True)
class World:
    """The ranks of this job and where this one runs. ``comm`` is their communicator: MPI's
    world, or the ranks a ``hierarchy=auto`` plan uses (``sub_world``)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    n_nodes: int
    hostname: str
    hosts: tuple[str, ...] = ()  # every rank's host, in rank order
    comm: Any = field(default=None, compare=False, repr=False)


def mpi():
    from mpi4py import MPI

    return MPI


def world_info() -> World:
    return sub_world(mpi().COMM_WORLD)


def sub_world(comm) -> World:
    """The ``World`` of the ranks of ``comm`` (collective over ``comm``)."""
    MPI = mpi()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    hosts = comm.allgather(MPI.Get_processor_name())
    w = World(
        rank=comm.Get_rank(),
        size=comm.Get_size(),
        local_rank=node.Get_rank(),
        local_size=node.Get_size(),
        n_nodes=len(set(hosts)),
        hostname=hosts[comm.Get_rank()],
        hosts=tuple(hosts),
        comm=comm,
    )
    node.Free()
    return w


def check_singletons(world: World) -> None:
    """Guard against ``srun --mpi=none``: N copies of a 1-rank world instead of one N-rank world."""
    for var in ("SLURM_NTASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        expected = os.environ.get(var)
        if expected and expected.isdigit() and int(expected) > 1 and world.size == 1:
            raise RuntimeError(
                f"{var}={expected} but MPI reports a world of 1: the ranks did not form one MPI "
                "world (with Slurm use `srun --mpi=pmi2`, or mpiexec inside the allocation)"
            )


# A rendezvous step that torch does not end by its timeout (the step's deadline) is ended by the
# start-up watchdog this much later.
STEP_GRACE_S = 15.0


class InterfaceError(UserError, ValueError):
    """The configured rendezvous interface does not exist or has no IPv4 address."""


def _iface_address(iface: str) -> str:
    """The interface's first IPv4 address, as psutil lists them."""
    import psutil

    addrs = psutil.net_if_addrs()
    if iface not in addrs:
        raise InterfaceError(
            f"transport.iface={iface}: no such network interface here (have: {', '.join(sorted(addrs))})"
        )
    for a in addrs[iface]:
        if a.family == socket.AF_INET:
            return a.address
    raise InterfaceError(f"transport.iface={iface}: the interface has no IPv4 address")


Addresses = dict[str, list[tuple[str, str]]]  # interface -> [(IPv4 address, netmask)]


def ipv4_interfaces() -> Addresses:
    import psutil

    return {
        name: [(a.address, a.netmask) for a in addrs if a.family == socket.AF_INET and a.netmask]
        for name, addrs in psutil.net_if_addrs().items()
    }


def pick_interface(mine: Addresses, others: list[Addresses]) -> str | None:
    """The interface of ``mine`` whose IPv4 network holds an address of every host in ``others``
    (the other hosts' interfaces), loopback excluded; None when there is none. Picked this way,
    the rendezvous works without a resolvable host name or a configured interface (hosts whose
    names resolve to an address on another network, or not at all, are common)."""
    import ipaddress

    for name in sorted(mine):
        for addr, mask in mine[name]:
            net = ipaddress.ip_interface(f"{addr}/{mask}").network
            if net.is_loopback:
                continue
            if all(
                any(ipaddress.ip_address(a) in net for addrs in other.values() for a, _ in addrs)
                for other in others
            ):
                return name
    return None


def rendezvous_interface(world: World, configured: str | None) -> str:
    """This rank's interface for the rendezvous and gloo's pairs (collective): the configured
    one (``transport.iface``, else ``GLOO_SOCKET_IFNAME``), ``lo`` on one node, else the one on
    the network shared with every other host (``pick_interface``)."""
    configured = configured or os.environ.get("GLOO_SOCKET_IFNAME")
    if world.n_nodes == 1:
        return configured or "lo"
    mine = ipv4_interfaces()
    everyone = world.comm.allgather((world.hostname, mine))
    if configured:
        return configured
    others = [addrs for host, addrs in dict(everyone).items() if host != world.hostname]
    picked = pick_interface(mine, others)
    if picked is None:
        have = ", ".join(f"{n} {[a for a, _ in v]}" for n, v in sorted(mine.items()) if v)
        raise InterfaceError(
            f"no interface of {world.hostname} is on a network with every other host ({have}): "
            "set transport.iface"
        )
    return picked


Step = Callable[[str, float], AbstractContextManager]  # (step, its limit in s) -> a context around it


def init_torch_distributed(
    world: World, backend: str, iface: str | None, port: int | None = None, timeout_s: float = 60.0,
    step: Step | None = None, setting: str = "transport.rendezvous_timeout_s",
    op_timeout_s: float = 7 * 24 * 3600.0,
) -> None:  # fmt: skip
    """Initialise torch.distributed over the MPI world (rank 0 picks its address, and a free
    port unless ``port`` is given), each step ended within ``timeout_s`` of the start, else
    ``RendezvousError`` naming the ranks that did not answer and the ``setting`` behind the limit
    (comm/rendezvous.py). ``step(name, limit_s)`` wraps each step (the start-up watchdog's phase,
    a backstop ``STEP_GRACE_S`` later). Its operations then wait up to ``op_timeout_s``
    (``transport.op_timeout_s``)."""
    import torch.distributed as dist

    from pipespec_mpi.comm import rendezvous as rv

    if dist.is_initialized():
        return
    step = step or (lambda name, limit_s: nullcontext())
    comm = world.comm
    deadline = rv.Deadline(timeout_s, setting)
    with step("check-in", deadline.left() + STEP_GRACE_S):
        rv.check_in(comm, world.hosts, deadline)
    with step("address", deadline.left() + STEP_GRACE_S):
        iface = rendezvous_interface(world, iface)
        os.environ["GLOO_SOCKET_IFNAME"] = iface
        os.environ.setdefault("NCCL_SOCKET_IFNAME", iface)
        addr = None
        if world.rank == 0:
            addr = "127.0.0.1" if world.n_nodes == 1 else _iface_address(iface)
            if port is None:
                with socket.socket() as s:
                    s.bind((addr, 0))
                    port = s.getsockname()[1]
        addr, port = comm.bcast((addr, port), root=0)  # rank 0's choice
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    with step("store", deadline.left() + STEP_GRACE_S):
        store = rv.open_store(world.rank, world.size, addr, port, world.hosts, deadline)
        rv.mark(store, world.rank)
        rv.wait_marked(store, world.size, world.hosts, deadline)
    with step(f"{backend} pairs", deadline.left() + STEP_GRACE_S):
        rv.connect_pairs(backend, store, world.rank, world.size, world.hosts, deadline, op_timeout_s)


def shutdown_torch_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def abort(exc: BaseException, where: str) -> None:
    """Print this rank's error and bring the whole job down (never leave peers hanging)."""
    msg = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    abort_job(f"\n[pipespec_mpi] FATAL on {where}:\n{msg}\n", code=1)


def abort_job(message: str, code: int) -> None:
    """Write ``message`` to stderr and this rank's log, then abort every rank with ``code``.

    The pause before the abort lets mpirun forward the message: Hydra tears the proxies down on
    an abort, and output still in their pipes is lost with them (a CI run once kept only rank 0's
    first log line of a stall report). The rank's log file keeps the message either way.
    """
    sys.stderr.write(message)
    sys.stderr.flush()
    record = logging.LogRecord("pipespec_mpi", logging.ERROR, __file__, 0, message.strip(), None, None)
    for handler in logging.getLogger().handlers:  # the file only: the console already has it
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
            handler.flush()
    time.sleep(1.0)
    try:
        mpi().COMM_WORLD.Abort(code)
    finally:
        os._exit(code)  # MPICH's Abort may return before the process manager kills us
