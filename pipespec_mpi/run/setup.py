"""A rank's setup before its first job: placement (threads, GPUs, transport), the tokenizer and
prompts every stage agrees on, its stage's model, the proposal channels and the epochs window,
and the stage loop over them.

Every function here that calls a collective is called by every rank in the same order
(``Runner.run``): tokenizer fingerprints, prompts, vocabularies, hosts, communicators, window.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipespec_mpi.comm.bootstrap import World, init_torch_distributed, mpi
from pipespec_mpi.comm.channel import Receiver, Sender
from pipespec_mpi.comm.links import LinkSpec, open_receiver, open_sender
from pipespec_mpi.comm.mux import Demux, SlotReceiver, SlotSender
from pipespec_mpi.comm.strict import StrictP2P
from pipespec_mpi.comm.window import EpochWindow, PushedEpochWindow, SharedEpochWindow
from pipespec_mpi.comm.wire import slot_tag
from pipespec_mpi.config import DRAFTER_KINDS, AppConfig, ConfigError, HierarchyConfig
from pipespec_mpi.config.schema import Transport
from pipespec_mpi.data.datasets import BadRow
from pipespec_mpi.errors import UserError
from pipespec_mpi.host.doorbell import Doorbell, RingingSender, RingingWindow, bell_covers
from pipespec_mpi.host.placement import CpuPlacement, share_cpus
from pipespec_mpi.host.wait import sleep_at_barrier, wait_until
from pipespec_mpi.platforms import Resolved, current_platform
from pipespec_mpi.run import rows
from pipespec_mpi.run.jobs import batch_sizes
from pipespec_mpi.run.online import extra_routes
from pipespec_mpi.run.rows import RowFeed
from pipespec_mpi.run.startup import StartupWatchdog
from pipespec_mpi.stage.loop import StageLoop
from pipespec_mpi.stage.ports import Proposer, Scorer, StagePorts, StageRole
from pipespec_mpi.topology import Placement

if TYPE_CHECKING:
    from mpi4py import MPI

    from pipespec_mpi.data.requests import DatasetError
    from pipespec_mpi.models.tokenizer import Tokenizer
    from pipespec_mpi.run.gpu_monitor import GpuMonitor

log = logging.getLogger("pipespec_mpi")


class TokenizerMismatch(UserError):
    pass


class PerfClock:
    """The stage's clock on a rank: ``time.perf_counter`` (one clock for the processes of a node)."""

    def now(self) -> float:
        return time.perf_counter()


def place_cpus(
    hier: HierarchyConfig, stage: int, world: World, mode: str, routes: Sequence[tuple[int, ...]] = ()
) -> CpuPlacement:
    """This rank's share of its node (``host/placement.py share_cpus``, from every rank's CPU affinity:
    collective over ``world.comm``; model-free stages count as light), its torch threads set; and
    its share on each of ``routes`` it decodes on, among the stages of the route alone."""
    affinities = [frozenset(a) for a in world.comm.allgather(sorted(os.sched_getaffinity(0)))]
    threads = hier.stages[stage].threads
    k = hier.n_stages
    share = share_cpus(world.rank, world.hosts, affinities, k, threads, hier.model_free)
    on_route = {}
    for route in routes:
        if stage not in route:
            continue
        ranks = [r for r in range(world.size) if r % k in route]  # replica-major, as on the hierarchy
        light = frozenset(i for i, s in enumerate(route) if s in hier.model_free)
        on_route[tuple(route)] = share_cpus(
            ranks.index(world.rank), [world.hosts[r] for r in ranks], [affinities[r] for r in ranks],
            len(route), threads, light,
        )  # fmt: skip
    return CpuPlacement(share, mode, on_route)


@dataclass
class Loaded:
    """What a rank holds once loaded: where it runs, and what every stage agreed on."""

    seam: Resolved  # what the device seam decided for this rank (platforms.py)
    p2p: StrictP2P | None  # transport.kind=strict: its communicator; else None
    cpus: CpuPlacement
    tokenizer: Tokenizer
    feed: RowFeed  # this replica's prompts, a round at a time (run/rows.py)
    n_prompts: int  # how many this replica decodes in all
    bad: list[BadRow]  # rank 0: the rows not decoded, and why (errors.jsonl); others: none
    row_error: DatasetError | None  # the job stops on its rows (the same on every rank)
    sampled: bool  # some job of the job samples (its temperature, or a row's own)
    model: Scorer | Proposer
    engines: list[str]  # per stage: the forward and plug-ins it runs (the same on every rank)
    seams: list[str]  # per stage: what the device seam decided for it (the same on every rank)
    vocab: int  # the widest logit row of the stages
    gpu_monitor: GpuMonitor


def load(cfg: AppConfig, world: World, pl: Placement, watchdog: StartupWatchdog) -> Loaded:
    """Threads, GPUs and transport for this rank; the tokenizer (checked against every stage's);
    this stage's model (checked against every stage's vocabulary); the rows, judged by rank 0
    against the smallest context and fed a round at a time (run/rows.py). Each phase runs
    under ``watchdog`` (run/startup.py)."""
    import torch

    from pipespec_mpi.models.loader import load_stage, load_tokenizer
    from pipespec_mpi.run.gpu_monitor import GpuMonitor

    comm = world.comm
    stage_cfg = cfg.hierarchy.stages[pl.stage]
    cpus = place_cpus(cfg.hierarchy, pl.stage, world, cfg.run.cpu_bind, extra_routes(cfg))
    seam = current_platform().resolve(cfg, world)
    log.info("stage %d: %s", pl.stage, seam.describe())
    cuda_devices = list(seam.devices)
    p2p = rendezvous(cfg, world, seam.transport, watchdog)

    with watchdog.phase("tokenizer"):
        tokenizer = load_tokenizer(cfg.hierarchy.tokenizer, cfg.hierarchy.name)
        check_tokenizers(cfg, pl, comm, tokenizer)

    with watchdog.phase(f"model load (stage {pl.stage}, {stage_cfg.name})"):
        t0 = time.perf_counter()
        model = load_stage(cfg.hierarchy, pl.stage, cuda_devices, seam.kernels, seam.compile)
        if cpus.share.solo is not None and not getattr(model, "thread_invariant", False):
            cpus.as_alone()  # no method's output may differ from AR's by its threads
            log.info("stage %d: %d threads in every method (not thread-invariant)", pl.stage, cpus.threads)
        compiled = getattr(model, "compiled", False)  # dynamo guards on the thread count
        if compiled or not seam.thread_shares:
            cpus.one_count()
        if compiled:  # its graphs made now, under the threads it decodes with (not mid-prompt)
            seconds = model.warm_up(max(batch_sizes(cfg)))
            log.info("stage %d: its compiled forward's graphs made in %.1f s", pl.stage, seconds)
        log.info(
            "stage %d (%s) loaded in %.1f s, %d threads on %s",
            *(pl.stage, stage_cfg.name, time.perf_counter() - t0, cpus.threads, cpus.where),
        )
        sleep_at_barrier(comm)  # the stages load for seconds to minutes; MPICH's collectives spin
        context = smallest_context(cfg, pl, comm, model)
        engines = per_stage(pl, comm, engine_of(model))
        seams = per_stage(pl, comm, seam.describe())

    with watchdog.phase("rows"):
        found = rows.scan(cfg, comm, tokenizer, context)
        loaded = Loaded(
            seam=seam,
            p2p=p2p,
            cpus=cpus,
            tokenizer=tokenizer,
            feed=rows.feed(cfg, comm, pl, tokenizer, context),
            n_prompts=found.share(pl.replica, pl.n_replicas),
            bad=found.bad,
            row_error=found.error,
            sampled=found.sampled,
            model=model,
            engines=engines,
            seams=seams,
            vocab=0,
            gpu_monitor=GpuMonitor(cuda_devices if torch.cuda.is_available() else []),
        )
        loaded.vocab = agree_vocab(cfg, pl, comm, model, tokenizer, loaded.sampled)
    return loaded


def rendezvous(
    cfg: AppConfig, world: World, transport: Transport, watchdog: StartupWatchdog
) -> StrictP2P | None:
    """torch.distributed for a torch transport (gloo, nccl, strict), each step of its rendezvous
    a phase of ``watchdog``; strict's communicator (comm/strict.py StrictP2P), else None.
    Collective over the world."""
    backend = transport.torch_backend
    if backend is None:
        return None
    t = cfg.transport

    # the rendezvous' own bound, or the start-up's limit for any phase where that is tighter
    limit_s, setting = min((t.rendezvous_timeout_s, "transport.rendezvous_timeout_s"),
                           (cfg.run.startup_timeout_s, "run.startup_timeout_s"))  # fmt: skip

    def step(name: str, step_s: float):
        return watchdog.phase(f"rendezvous ({transport}): {name}", step_s, setting)

    init_torch_distributed(world, backend, t.iface, t.port, limit_s, step, setting, t.op_timeout_s)
    return StrictP2P(world.rank, timeout_s=cfg.run.stall_timeout_s) if transport == Transport.strict else None


def check_tokenizers(cfg: AppConfig, pl: Placement, comm, tokenizer) -> None:
    """Every stage must use the hierarchy's token ids: compare tokenizer fingerprints."""
    from pipespec_mpi.models.loader import stage_tokenizer, tokenizer_mismatches

    st = stage_tokenizer(cfg.hierarchy, pl.stage)
    mine = (pl.stage, cfg.hierarchy.stages[pl.stage].name, st.fingerprint() if st is not None else None)
    bad = tokenizer_mismatches(tokenizer.fingerprint(), comm.allgather(mine))
    if bad:
        err = TokenizerMismatch("stages do not share one tokenizer: " + "; ".join(bad))
        err.collective = True  # every rank saw the same gathered fingerprints
        raise err


def smallest_context(cfg: AppConfig, pl: Placement, comm, model) -> tuple | None:
    """(context, stage, name) of the stage with the smallest context (gathered: the same on
    every rank); None when no stage has a limit."""
    mine = (getattr(model, "max_context", None), pl.stage, cfg.hierarchy.stages[pl.stage].name)
    contexts = [got for got in comm.allgather(mine) if got[0] is not None]
    return min(contexts) if contexts else None


def engine_of(model) -> str:
    """The forward and plug-ins ``model`` runs (``describe``; a model-free drafter its kind)."""
    describe = getattr(model, "describe", None)
    return describe() if describe is not None else f"model-free ({type(model).__name__})"


def per_stage(pl: Placement, comm, mine: str) -> list[str]:
    """Every stage's ``mine``, gathered: the same on every rank (the first replica's where
    replicas differ)."""
    found: dict[int, str] = {}
    for stage, text in comm.allgather((pl.stage, mine)):
        found.setdefault(stage, text)
    return [found[s] for s in sorted(found)]


def agree_vocab(cfg: AppConfig, pl: Placement, comm, model, tokenizer, sampled: bool) -> int:
    """All stages must speak the tokenizer's ids: gather (stage, model vocab) and compare; the
    widest logit row (``sampled``: some job samples)."""
    vocab = getattr(model, "vocab_size", None)
    got = comm.allgather((pl.stage, cfg.hierarchy.stages[pl.stage].name, vocab))
    widths = {v for _, _, v in got if v is not None}
    if len(widths) > 1 and sampled and cfg.sampling.coupling == "leviathan":
        raise TokenizerMismatch(f"sampling needs equal logit widths across stages, got {sorted(widths)}")
    need = tokenizer.vocab_size
    bad = [
        f"stage {s} ({n}): model vocabulary {v} < tokenizer's {need}"
        for s, n, v in got
        if v is not None and v < need
    ]
    if bad:
        raise TokenizerMismatch("model vocabularies too small: " + "; ".join(sorted(set(bad))))
    return max(widths)


AnyWindow = EpochWindow | SharedEpochWindow | PushedEpochWindow


@dataclass
class Links:
    """A rank's connections: proposal channels to its neighbours, its epochs window, and the
    node's and the replica's communicators."""

    sender: Sender | SlotSender | None
    receiver: Receiver | SlotReceiver | None
    window: AnyWindow
    node_comm: MPI.Intracomm
    replica_comm: MPI.Intracomm

    def close(self, stall_timeout_s: float) -> None:
        """Graceful close (after a successful run only: after an error the job is aborted)."""
        wait = lambda c, w: wait_until(c, stall_timeout_s, w)  # noqa: E731
        if self.sender is not None:
            self.sender.close(wait)
        if self.receiver is not None:
            self.receiver.close(wait)
        self.window.free()
        self.replica_comm.Free()
        self.node_comm.Free()


def connect(
    cfg: AppConfig, world: World, pl: Placement, loaded: Loaded, slot: int = 0, pairs: dict | None = None,
    slots: int = 1,
) -> Links:  # fmt: skip
    """Proposal channels (with the distributions when Leviathan sampling), the epochs window
    (``open_window``), communicators: those of lane ``slot`` of ``slots`` lanes (batched
    decoding's slots, on each route a job may decode on: each has its own; collective, so every
    rank connects its lanes in the same order), between ``pl``'s neighbours on its route (one
    route decodes at a time: a pair's link carries one route's ``slots`` at once). The
    lanes' links: tagged apart on mpi and gloo; on nccl and strict, ports on one link per pair,
    opened by the first lane that needs it and kept in ``pairs`` for the others (comm/mux.py)."""
    comm = world.comm
    transport, device = loaded.seam.transport, None
    if transport == Transport.nccl:
        import torch

        device = torch.device(f"cuda:{loaded.seam.devices[0]}")
    t = cfg.transport
    # Leviathan sampling: each proposal carries the float32 distribution it was drawn from.
    leviathan = loaded.sampled and cfg.sampling.coupling == "leviathan"
    dist_width = loaded.vocab if leviathan else 0
    width = min(t.max_msg_tokens, 8) if dist_width > 4096 else t.max_msg_tokens
    sender: Sender | SlotSender | None
    receiver: Receiver | SlotReceiver | None
    if not transport.one_link_per_pair:
        chan = dict(
            depth=t.depth, max_msg_tokens=width, device=device, dist_width=dist_width, tag=slot_tag(slot)
        )
        sender = (
            open_sender(transport, comm, LinkSpec(pl.downstream, **chan))
            if pl.downstream is not None
            else None
        )
        receiver = (
            open_receiver(transport, comm, LinkSpec(pl.upstream, **chan)) if pl.upstream is not None else None
        )
    else:
        pairs = {} if pairs is None else pairs
        link_comm = loaded.p2p if transport == Transport.strict else comm
        # one route decodes at a time: a pair's link carries at most one route's slots at once
        chan = dict(depth=t.depth * slots, max_msg_tokens=width, device=device, dist_width=dist_width)
        sender = receiver = None
        if (
            pl.downstream is not None
        ):  # opened first: the pairs' first operations chain up from the last stage
            key = ("to", pl.downstream)
            owner = key not in pairs
            if owner:
                pairs[key] = open_sender(transport, link_comm, LinkSpec(pl.downstream, **chan))
                pairs[key].hello(lambda c, w: wait_until(c, cfg.run.stall_timeout_s, w))
            sender = SlotSender(pairs[key], slot, owner)
        if pl.upstream is not None:
            key = ("from", pl.upstream)
            owner = key not in pairs
            if owner:
                pairs[key] = Demux(open_receiver(transport, link_comm, LinkSpec(pl.upstream, **chan)))
            receiver = SlotReceiver(pairs[key], slot, owner)
    max_tokens = cfg.decode.max_new_tokens + cfg.decode.max_verify + 2
    node_comm = comm.Split_type(mpi().COMM_TYPE_SHARED, key=world.rank)
    window = open_window(cfg.run.epochs_window, comm, node_comm, world, pl, max_tokens)
    replica_comm = comm.Split(color=pl.replica, key=pl.stage)
    return Links(
        sender=sender, receiver=receiver, window=window, node_comm=node_comm, replica_comm=replica_comm
    )


def pipelines_local(hosts: Sequence[str], n_stages: int) -> bool:
    """Every pipeline's stages sit on one host (``hosts``: each rank's, in rank order)."""
    return all(hosts[r] == hosts[r - r % n_stages] for r in range(len(hosts)))


def window_kind(choice: str, hosts: Sequence[str], n_stages: int) -> str:
    """``auto``: shared memory when every pipeline sits on one node (its reads never wait), else
    pushed headers (a read costs a probe, never the owner's forward: bench/comm_latency.py)."""
    if choice != "auto":
        return choice
    return "shared" if pipelines_local(hosts, n_stages) else "push"


def open_window(choice: str, comm, node_comm, world: World, pl: Placement, max_tokens: int) -> AnyWindow:
    """This rank's epochs window (collective over ``comm``)."""
    kind = window_kind(choice, world.hosts, pl.n_stages)
    if kind == "shared":
        if not pipelines_local(world.hosts, pl.n_stages):
            raise ConfigError(
                [f"run.epochs_window=shared: a pipeline spans nodes ({sorted(set(world.hosts))})"]
            )
        return SharedEpochWindow(node_comm, max_tokens, world.rank)
    if kind == "rma":
        return EpochWindow(comm, max_tokens)
    neighbours, down = pl.neighbours, pl.downstream
    # the upstream reads this rank's tokens (rollbacks); the downstream only its idle flag
    header_only = [down] if down is not None else []
    return PushedEpochWindow(comm, max_tokens, neighbours, neighbours, header_only=header_only)


def open_doorbell(
    cfg: AppConfig, world: World, pl: Placement, loaded: Loaded, window: str
) -> Doorbell | None:
    """This rank's doorbell (host/doorbell.py; collective over the world): rank 0 draws the job's
    token, every rank binds its bell and rings the replica's other ranks once; whether the bell
    covers the rank (``bell_covers``, for the epochs ``window`` kind opened): whose hello came:
    ``heard``. None where the OS has no abstract sockets, or the seam says poll (``run.doorbell``
    off)."""
    if loaded.seam.waits != "doorbell":  # the same on every rank: no collective is skipped by some
        return None
    token = world.comm.bcast(secrets.token_hex(8) if world.rank == 0 else None, root=0)
    bell = Doorbell.open(token, world.rank)
    sleep_at_barrier(world.comm)  # every bell bound
    if bell is not None:
        for r in pl.peers:
            bell.ring(r)
    sleep_at_barrier(world.comm)  # every hello in its bell's queue (a local datagram is, once sent)
    if bell is None:
        return None
    leviathan = loaded.sampled and cfg.sampling.coupling == "leviathan"
    bell.heard = frozenset(bell.drain())
    bell.covers = bell_covers(window, loaded.seam.transport, leviathan, set(pl.neighbours), bell.heard)
    # every other stage of the replica reached it with a hello, so their rings as they join reach it
    bell.collectives = set(pl.peers) <= bell.heard
    log.info(
        "waiting stages sleep until a neighbour rings (doorbell)"
        if bell.covers
        else f"waiting stages poll, woken early by a ring (window {window}, transport {loaded.seam.transport}"
        f"{', leviathan' if leviathan else ''})"
    )
    return bell


def stage_loop(
    cfg: AppConfig, pl: Placement, loaded: Loaded, links: Links, slot: int = 0, bell: Doorbell | None = None,
    model: Scorer | Proposer | None = None,
) -> StageLoop:  # fmt: skip
    """This rank's stage loop over its model, window and channels, on the node's clock; slot
    s > 0 of batched decoding gets its own sequence on the same weights (``for_slot``), or
    ``model``'s (a route's loop shares the slot's sequence: one route decodes at a time). With
    a ``bell``, its publishes ring both neighbours and its proposals the downstream."""
    up = pl.upstream_stage
    free = up is not None and cfg.hierarchy.stages[up].kind in DRAFTER_KINDS
    role = StageRole(pl.stage, pl.n_stages, pl.world_rank, pl.upstream, pl.downstream, upstream_free=free)
    if model is None:
        model = loaded.model.for_slot() if slot else loaded.model
    window, sender = links.window, links.sender
    if bell is not None:
        window = RingingWindow(window, bell, pl.neighbours)
        if sender is not None:
            sender = RingingSender(sender, bell, pl.downstream)
    ports = StagePorts(window, PerfClock(), sender, links.receiver)
    return StageLoop(role, model, ports, cfg.decode, loaded.tokenizer.eos_token_id, vocab=loaded.vocab)
