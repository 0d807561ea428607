"""A multi-host bed on one Linux machine: each host is a network namespace with its own hostname,
and a wire process carries the IP packets between the hosts' TUN devices, after an added one-way
delay (an interconnect's latency; this kernel has no netem, so the wire is the delay line).

    python tests/multihost/netbed.py up --hosts 2 --delay-ms 0.1     # two hosts, 0.1 ms each way
    python tests/multihost/netbed.py mpirun -n 6 --ppn 3 -- python -m pipespec_mpi hierarchy=tiny
    python tests/multihost/netbed.py down

``mpirun`` runs MPICH's hydra inside host 0 with ``-hosts`` set to the hosts' addresses and a
launcher that enters the right namespace instead of ssh, so MPI sees as many nodes as hosts: the
ranks of one host share memory, the ranks of two hosts talk over TCP through the wire (UCX is held
to its TCP transport: left alone it finds the hosts' shared /dev/shm and bypasses the network,
0.006 ms round trips instead of 0.02-0.1 ms). Needs root, /dev/net/tun, ``ip`` and ``unshare``;
``problem()`` says which is missing. The tests bring a bed up and down themselves
(tests/multihost/); ``bench/comm_latency.py --bed`` measures across one.

Hosts are ``<name>-h<i>`` at ``10.<net>.0.<i+1>/24`` on ``tun0``, state in ``/run/pipespec-netbed/
<name>/`` (the hosts file, the launcher script, the wire's pid and log).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

STATE_ROOT = Path("/run/pipespec-netbed")
TUN = "tun0"
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class BedConfig:
    name: str = "psbed"
    hosts: int = 2
    delay_ms: float = 0.0  # added one-way delay of every packet between two hosts
    net: int = 78  # the hosts' addresses are 10.<net>.0.1 .. 10.<net>.0.<hosts>
    drop_tcp_ports: tuple[int, ...] = ()  # the wire drops TCP packets to these ports (a firewall)

    def __post_init__(self) -> None:
        problems = []
        if not 2 <= self.hosts <= 16:
            problems.append(f"hosts={self.hosts} (2..16)")
        if self.delay_ms < 0:
            problems.append(f"delay_ms={self.delay_ms} (>= 0)")
        if not 1 <= self.net <= 254:
            problems.append(f"net={self.net} (1..254)")
        problems += [f"drop_tcp_ports: {p} (1..65535)" for p in self.drop_tcp_ports if not 1 <= p <= 65535]
        if not self.name.isidentifier() or len(self.name) > 8:
            problems.append(f"name={self.name!r} (a short identifier: it prefixes namespace names)")
        if problems:
            raise ValueError("netbed: " + "; ".join(problems))

    def host(self, i: int) -> str:
        return f"{self.name}-h{i}"

    def address(self, i: int) -> str:
        return f"10.{self.net}.0.{i + 1}"

    @property
    def state(self) -> Path:
        return STATE_ROOT / self.name


def problem() -> str | None:
    """Why no bed can be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun (the kernel has no TUN driver)"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found"
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


# ---- the wire -----------------------------------------------------------------------------------
def _enter(ns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
    finally:
        os.close(fd)


def _open_tun(ns: str) -> int:
    _enter(ns)
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", TUN.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


def run_wire(cfg: BedConfig, ready: Path | None = None) -> None:
    """Carry IPv4 packets between the hosts' TUN devices, each one ``delay_ms`` after it was read
    (FIFO per destination: the delay is constant, so arrival order is departure order)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK 1 ns: wake at the packet's due time, not 50 us later
    fds = [_open_tun(cfg.host(i)) for i in range(cfg.hosts)]

    def _stop(*_: object) -> None:
        raise _Stop  # out of select() (which PEP 475 would otherwise resume)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    if ready is not None:
        ready.write_text(str(os.getpid()))
    try:
        _carry(cfg, fds)
    except _Stop:
        pass
    finally:
        for fd in fds:
            os.close(fd)


class _Stop(Exception):
    pass


def _tcp_port(pkt: bytes) -> int | None:
    """The destination port of an IPv4 TCP packet (None for anything else)."""
    ihl = (pkt[0] & 0x0F) * 4
    if pkt[9] != 6 or len(pkt) < ihl + 4:
        return None
    return int.from_bytes(pkt[ihl + 2 : ihl + 4], "big")


def _carry(cfg: BedConfig, fds: list[int]) -> None:
    host_of = {fd: i for i, fd in enumerate(fds)}
    prefix = bytes([10, cfg.net, 0])
    delay = cfg.delay_ms / 1000
    queues: list[deque[tuple[float, bytes]]] = [deque() for _ in fds]
    drop = frozenset(cfg.drop_tcp_ports)
    while True:
        due = min((q[0][0] for q in queues if q), default=None)
        timeout = None if due is None else max(0.0, due - time.monotonic())
        readable, _, _ = select.select(fds, [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            pkt = os.read(fd, 65536)
            if len(pkt) < 20 or pkt[0] >> 4 != 4 or pkt[16:19] != prefix:
                continue  # IPv6 (router solicitations), or not addressed to a host of the bed
            dst = pkt[19] - 1
            if drop and _tcp_port(pkt) in drop:
                continue  # firewalled: the sender sees no answer, as from a filtered port
            if 0 <= dst < len(fds) and dst != host_of[fd]:
                if delay == 0:
                    os.write(fds[dst], pkt)
                else:
                    queues[dst].append((now + delay, pkt))
        now = time.monotonic()
        for dst, q in enumerate(queues):
            while q and q[0][0] <= now:
                os.write(fds[dst], q.popleft()[1])


# ---- up / down ----------------------------------------------------------------------------------
_LAUNCHER = """#!/bin/sh
# hydra's launcher for this bed: "<launcher> [ssh options] <address> <command>" runs the command in
# the namespace of the host with that address, under the host's own hostname.
while [ "${1#-}" != "$1" ]; do shift; done
host=$(awk -v a="$1" '$1 == a {print $2}' "$(dirname "$0")/hosts")
shift
[ -n "$host" ] || { echo "netbed: no host with that address" >&2; exit 1; }
exec ip netns exec "$host" unshare --uts sh -c "hostname $host; $*"
"""


class NetBed:
    """A bed brought up on entry and torn down on exit (also usable as ``up()`` / ``down()``)."""

    def __init__(self, cfg: BedConfig) -> None:
        self.cfg = cfg
        self._wire: subprocess.Popen | None = None  # when this object started it (reaped on down)

    def __enter__(self) -> NetBed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        why = problem()
        if why:
            raise RuntimeError(f"netbed: {why}")
        cfg = self.cfg
        self.down()  # a bed of the same name left by a killed run
        cfg.state.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(cfg.hosts):
                h = cfg.host(i)
                _ip("netns", "add", h)
                _ip("link", "set", "lo", "up", ns=h)
                _ip("tuntap", "add", "dev", TUN, "mode", "tun", ns=h)
                _ip("addr", "add", f"{cfg.address(i)}/24", "dev", TUN, ns=h)
                _ip("link", "set", TUN, "up", ns=h)
            (cfg.state / "hosts").write_text(
                "".join(f"{cfg.address(i)} {cfg.host(i)}\n" for i in range(cfg.hosts))
            )
            launcher = cfg.state / "launch"
            launcher.write_text(_LAUNCHER)
            launcher.chmod(0o755)
            ready = cfg.state / "wire.pid"
            args = [sys.executable, str(Path(__file__).resolve()), "wire", "--name", cfg.name]
            args += ["--hosts", str(cfg.hosts), "--delay-ms", str(cfg.delay_ms), "--net", str(cfg.net)]
            args += [f"--drop-tcp-port={p}" for p in cfg.drop_tcp_ports]
            with open(cfg.state / "wire.log", "w") as log:
                self._wire = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
            deadline = time.monotonic() + 30
            while not ready.exists():
                if time.monotonic() > deadline:
                    log = (cfg.state / "wire.log").read_text()
                    raise RuntimeError(f"netbed: the wire did not start: {log}")
                time.sleep(0.05)
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        cfg = self.cfg
        pid_file = cfg.state / "wire.pid"
        if pid_file.exists():
            try:
                pid = int(pid_file.read_text())
                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    if self._wire is not None and self._wire.poll() is not None:
                        break
                    os.kill(pid, 0)
                    time.sleep(0.02)
            except (ValueError, ProcessLookupError):
                pass
        if self._wire is not None:
            self._wire.wait(timeout=5)
            self._wire = None
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in listed.splitlines():
            ns = line.split()[0] if line.strip() else ""
            if ns.startswith(f"{cfg.name}-h"):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if cfg.state.exists():
            shutil.rmtree(cfg.state, ignore_errors=True)

    # -- running things on the bed ------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """What MPI needs here: UCX held to TCP over the bed's device (see the module docstring),
        libfabric's TCP provider on it too. (gloo's interface is left for pipespec_mpi to pick.)"""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": TUN, "FI_PROVIDER": "tcp", "FI_TCP_IFACE": TUN}

    def mpirun(self, n: int, ppn: int, command: list[str], hosts: int | None = None) -> list[str]:
        """The argv that runs ``command`` as ``n`` MPI ranks, ``ppn`` per host, over the first
        ``hosts`` hosts (all by default), from host 0."""
        cfg = self.cfg
        # the addresses of the bed as it was brought up (the hosts file), whatever this object's
        # --hosts / --net say (the CLI's mpirun only names the bed)
        addresses = [line.split()[0] for line in (cfg.state / "hosts").read_text().splitlines()]
        addresses = addresses[:hosts] if hosts is not None else addresses
        mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
        argv = ["ip", "netns", "exec", cfg.host(0), "unshare", "--uts", "sh", "-c"]
        argv += [f'hostname {cfg.host(0)}; exec "$0" "$@"', mpiexec, "-launcher", "ssh"]
        argv += ["-launcher-exec", str(cfg.state / "launch"), "-iface", TUN]
        argv += ["-hosts", ",".join(addresses), "-ppn", str(ppn), "-n", str(n)]
        for k, v in self.env().items():
            argv += ["-genv", k, v]
        return argv + command


def _config(args: argparse.Namespace) -> BedConfig:
    return BedConfig(
        name=args.name, hosts=args.hosts, delay_ms=args.delay_ms, net=args.net,
        drop_tcp_ports=tuple(args.drop_tcp_port),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/multihost/netbed.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("up", "down", "wire", "mpirun"):
        s = sub.add_parser(name)
        s.add_argument("--name", default=BedConfig.name)
        s.add_argument("--hosts", type=int, default=BedConfig.hosts)
        s.add_argument("--delay-ms", type=float, default=BedConfig.delay_ms)
        s.add_argument("--net", type=int, default=BedConfig.net)
        s.add_argument("--drop-tcp-port", type=int, action="append", default=[],
                       help="the wire drops TCP packets to this port (a firewall; repeatable)")  # fmt: skip
        if name == "mpirun":
            s.add_argument("-n", type=int, required=True)
            s.add_argument("--ppn", type=int, required=True)
            s.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cfg = _config(args)
    bed = NetBed(cfg)
    if args.cmd == "up":
        bed.up()
        hosts = ", ".join(f"{cfg.host(i)}={cfg.address(i)}" for i in range(cfg.hosts))
        print(f"netbed {cfg.name}: {cfg.hosts} hosts {hosts}, {cfg.delay_ms} ms one way")
    elif args.cmd == "down":
        bed.down()
    elif args.cmd == "wire":
        run_wire(cfg, ready=cfg.state / "wire.pid")
    else:
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        hosts_file = cfg.state / "hosts"
        if not hosts_file.exists():
            up = f"python tests/multihost/netbed.py up --name {cfg.name}"
            print(f"netbed {cfg.name} is not up: {up}", file=sys.stderr)
            return 2
        return subprocess.run(bed.mpirun(args.n, args.ppn, command)).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
