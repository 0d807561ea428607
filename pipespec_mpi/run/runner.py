"""One job on one rank, start to end: set up (setup.py), plan the replica's jobs (jobs.py), drive
the stage over them (``StageProcess`` + ``drive``, with the MPI gate and handoff of collect.py),
then rank 0 writes the run's files (finalize.py).

Batched decoding (``decode.batch_size``, a benchmark's ``run.batch_sizes``): the jobs come in
phases of one batch size; a phase of batch B runs B slots (each its own ``StageProcess`` over
its own links, window and communicators) under one ``BatchedStage``, whose forwards run together;
a slot that finishes takes the phase's next job (stage/deal.py: a queue the slots share). A
replica's phases are separated by a barrier of its ranks."""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import psutil

from pipespec_mpi.comm.bootstrap import World, mpi
from pipespec_mpi.config import AppConfig
from pipespec_mpi.errors import UserError
from pipespec_mpi.host.doorbell import Doorbell, RingingDeal, RingingGate, RingingHandoff
from pipespec_mpi.host.wait import StallError, wait_until
from pipespec_mpi.records import ERRORS, write_errors
from pipespec_mpi.run import setup
from pipespec_mpi.run.collect import (
    Collector,
    LeaderHandoff,
    Progress,
    RecordAssembler,
    VoteDeal,
    VoteGate,
    part_path,
    progress_bar,
)
from pipespec_mpi.run.decisions import OnlineDecisions, PlanMemory, WaitFor
from pipespec_mpi.run.drain import StopRequest, clear_stale_stop_file, exit_code
from pipespec_mpi.run.drive import drive
from pipespec_mpi.run.faults import maybe_fail
from pipespec_mpi.run.finalize import finalize
from pipespec_mpi.run.gpu_monitor import GpuMonitor
from pipespec_mpi.run.jobs import (
    Job,
    JobKey,
    batch_sizes,
    count_jobs,
    done_jobs,
    phases,
    plan_jobs,
    sampler_for,
)
from pipespec_mpi.run.online import extra_routes
from pipespec_mpi.run.setup import PerfClock
from pipespec_mpi.run.startup import StartupWatchdog
from pipespec_mpi.speculative.verifiers import make_verifier
from pipespec_mpi.stage.batch import BatchedStage
from pipespec_mpi.stage.deal import JobQueue
from pipespec_mpi.stage.loop import StageLoop, Step
from pipespec_mpi.stage.process import StageProcess
from pipespec_mpi.stage.prompt import On, Wait
from pipespec_mpi.topology import Placement, place

log = logging.getLogger("pipespec_mpi")

# How long the other ranks wait for rank 0's finalize (run/finalize.py). It reads every record back
# and writes every output file: a 100,000-row job's took over the 120 s stall limit beside other
# work, and the wait for it ended that job. It is not the protocol (a rank 0 that fails there
# aborts the job at once), so it gets an hour, not run.stall_timeout_s.
FINALIZE_WAIT_S = 3600.0


LEARN_TAG = 13  # the leader's outputs to the model-free stages that sat a prompt out


def _received(req, into: list) -> bool:
    """An mpi4py ``irecv`` tested: its object appended to ``into`` once it arrived."""
    done, obj = req.test()
    if done:
        into.append(obj)
    return done


class Collective:
    """A replica collective as a steppable (``drive`` waits for it): DONE once ``done()``, the
    loops taking in proposals and beating meanwhile."""

    def __init__(self, done: Callable[[], bool], loops: list[StageLoop], what: str) -> None:
        self.done, self.loops, self.what = done, loops, what

    def step(self) -> Step:
        for loop in self.loops:
            loop.pump()
        return Step.DONE if self.done() else Step.WAITING

    def wait(self) -> Wait:
        return Wait(On.COLLECTIVE)

    def describe(self) -> str:
        return f"waiting for {self.what}"


class Runner:
    def __init__(self, cfg: AppConfig, run_dir: Path, world: World, memory: PlanMemory | None = None) -> None:
        self.cfg, self.run_dir, self.world = cfg, run_dir, world
        self.comm = world.comm
        self.pl = place(world.rank, world.size, cfg.hierarchy.n_stages)
        self.bell: Doorbell | None = None  # set up with the links (host/doorbell.py)
        self.memory = memory  # what the online plan starts from and leaves for the next job
        self.collector: Collector | None = None

    def run(self) -> int:
        """Decode this rank's jobs; the job's exit code (0, or run/drain.py's when it was asked to
        stop early), the same on every rank."""
        cfg, pl = self.cfg, self.pl
        stop = StopRequest(self.run_dir)
        if self.world.rank == 0:  # before _done()'s broadcast: no rank reads it earlier
            clear_stale_stop_file(self.run_dir, psutil.Process().create_time())
        watchdog = StartupWatchdog(cfg.run.startup_timeout_s, self.world.rank, self.world.hosts)
        loaded = setup.load(cfg, self.world, pl, watchdog)
        if self.world.rank == 0:  # before any job: shards status counts them while the job runs
            write_errors(self.run_dir / ERRORS, [b.to_json() for b in loaded.bad])
        if loaded.row_error is not None:  # the same on every rank: all raise, rank 0 reports
            loaded.row_error.collective = True
            raise loaded.row_error
        n_slots = max(batch_sizes(cfg))
        routes: list[tuple[int, ...] | None] = [None, *extra_routes(cfg)]  # None: the whole hierarchy
        with watchdog.phase("channels and windows"):
            pairs: dict = {}  # nccl and strict: one link per pair, its lanes' ports on it
            lanes = {
                route: [
                    setup.connect(cfg, self.world, self._on(route), loaded, i * n_slots + s, pairs, n_slots)
                    for s in range(n_slots)
                ]
                for i, route in enumerate(routes)
            }
            self.bell = setup.open_doorbell(cfg, self.world, pl, loaded, lanes[None][0].window.kind)
        watchdog.close()
        slot_links = lanes[None]
        loops = [
            setup.stage_loop(cfg, pl, loaded, ln, slot=s, bell=self.bell) for s, ln in enumerate(slot_links)
        ]
        # a route's loops share the whole hierarchy's sequences (one route decodes at a time)
        self.route_loops = {None: loops} | {
            route: [
                setup.stage_loop(cfg, self._on(route), loaded, ln, s, self.bell, loops[s].model)
                for s, ln in enumerate(lanes[route])
            ]
            for route in routes[1:]
            if pl.stage in route
        }
        links = slot_links[0]
        self.online = OnlineDecisions(cfg, pl, self.memory)
        done_keys = self._done()
        total = count_jobs(cfg, loaded.n_prompts)
        hosts = [self.world.hosts[r] for r in pl.replica_ranks()]  # per stage of this replica
        collector = None
        if pl.is_last:
            assemble = RecordAssembler(
                cfg, replica=pl.replica, transport=loaded.seam.transport, decode=loaded.tokenizer.decode,
                epochs_window=links.window.kind, hosts=hosts, engines=loaded.engines, seams=loaded.seams,
            )  # fmt: skip
            collector = Collector(
                assemble,
                part=part_path(self.run_dir, pl.replica),
                progress=progress_bar(cfg, pl, total),
                log_progress=Progress(pl.replica, total, cfg.run.progress_every_s),
            )
        self.collector = collector
        index: dict[int, int] = {}  # job seq -> its place among the replica's jobs (faults.py)

        def slot(s: int, group: list[Job], queue: JobQueue | None) -> StageProcess:
            """Slot s's process over a phase's jobs: all of them in order (``queue`` None: batch
            1), else the next one the last stage's slots take from their shared ``queue``."""
            # GPU energy is per job; batched jobs overlap, so they are not measured
            monitor = loaded.gpu_monitor if queue is None else GpuMonitor([])
            comm = slot_links[s].replica_comm
            to_leader = LeaderHandoff(
                comm, pl.stage, pl.n_stages, gpu_monitor=monitor, on_record=collector,
                cpus=loaded.cpus, slot=s,
                n_gpus=len(loaded.seam.devices) if loaded.gpu_monitor.devices else 0,
            )  # fmt: skip

            def started(job: Job) -> None:
                maybe_fail(self.world.rank, index[job.seq])
                loaded.cpus.enter(job.batch_size, job.method, job.route)
                to_leader.started()  # the job's measurements: the rank's CPU time, its GPUs

            handoff = to_leader
            gate = VoteGate(comm, stop)
            deal = None if queue is None else VoteDeal(comm, queue if pl.is_last else None)
            if self.bell is not None:  # joining one rings the replica's other stages
                gate = RingingGate(gate, self.bell, pl.peers)
                handoff = RingingHandoff(handoff, self.bell, pl.peers)
                deal = None if deal is None else RingingDeal(deal, self.bell, pl.peers)
            return StageProcess(
                self._loops_for(group[0].route)[s], gate, handoff, group,
                verifier_for=lambda job: make_verifier(sampler_for(cfg, job), pl.stage), on_start=started,
                deal=deal,
            )  # fmt: skip

        # A round of rows at a time (run/rows.py): plan its jobs, decode them, then every replica
        # takes the next round together; a stop agreed by any replica ends the rounds.
        done = skipped = seq = n_left = 0
        while True:
            loaded.feed.prepare()
            self._barrier(loops, "the replicas to take the next round of rows")
            if self.comm.allreduce(n_left, op=mpi().MAX):  # after the barrier: nobody spins here
                break
            prompts = loaded.feed.next()
            if prompts is None:
                break
            first = seq == 0
            jobs = plan_jobs(cfg, prompts, done_keys, warmups=first, first_seq=seq)
            numbered = count_jobs(cfg, len(prompts), warmups=first)
            seq += numbered
            earlier = numbered - len(jobs)  # a resumed run's, done before
            skipped += earlier
            if collector is not None:
                collector.skipped(earlier)
            index.update({job.seq: len(index) + i for i, job in enumerate(jobs)})
            n_done, n_left = self._decode(phases(jobs), loops, slot, links)
            done += n_done
        if collector is not None:
            collector.close()
        # every rank left the rounds after their barrier: all replicas have finished
        left = total - done - skipped  # not started: this round's and every later round's
        left = self.comm.allreduce(left if pl.is_last else 0)
        finished = self.comm.allreduce(done if pl.is_last else 0)
        if self.world.rank == 0:
            finalize(cfg, self.run_dir)
            if left:
                log.warning(
                    f"stopped on request (SIGUSR2 or {stop.path.name}): {finished} prompt runs done, "
                    f"{left} not started; rerun in {self.run_dir} with run.resume=true"
                    + (
                        ""
                        if finished
                        else " (none done: the stop came before the first prompt ended;"
                        " a time-limit signal needs a lead time shorter than the job's limit)"
                    )
                )
        self._barrier(
            loops, "rank 0 to write the summary", timeout_s=max(cfg.run.stall_timeout_s, FINALIZE_WAIT_S)
        )
        # Graceful close only on success: after an error this rank aborts the job instead of
        # waiting for peers that may never answer.
        self.online.close(self.run_dir)
        for route in routes:
            for ln in lanes[route]:
                ln.close(cfg.run.stall_timeout_s)
        if self.bell is not None:
            self.bell.close()
        stop.close()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        log.info("peak RSS of this rank: %.0f MB (its finalize included)", peak)
        return exit_code(left, finished)

    def _decode(
        self,
        groups: list[list[Job]],
        loops: list[StageLoop],
        slot: Callable[[int, list[Job], JobQueue | None], StageProcess],
        links: setup.Links,
    ) -> tuple[int, int]:
        """Drive the stage over the phases (``slot(s, jobs, queue)`` builds slot s's process):
        one slot alone at batch 1, a ``BatchedStage`` over B slots else, which take the phase's
        jobs from one queue (stage/deal.py); each job starts on the threads and CPUs its method
        and batch size get (``CpuPlacement.enter``, in the slot's start hook). Returns the jobs
        handed over and those not started (the replica agreed to stop: later phases are not
        started)."""
        parts = [part for group in groups for part in self.online.split(group)]
        done = left = 0
        for g, part in enumerate(parts):
            if part[0].method == "online":  # its plan: the leader's pick, told to every stage
                part = self.online.agree(part, links.replica_comm, self._replica_wait(loops))
            size = part[0].batch_size
            b = min(size, len(part))
            for loop in self._all_loops():  # between phases: no prompt in flight
                loop.enter_phase(self.cfg.decode.for_batch(size))
            queue = None if b == 1 else JobQueue(len(part))
            slots = [slot(s, part, queue) for s in range(b)]
            stepper = slots[0] if b == 1 else self._batched(slots)
            tokens, t0 = self._tokens(), time.perf_counter()
            try:
                drive(stepper, self.cfg.run.stall_timeout_s, self.bell)
            except StallError as err:
                raise StallError(f"{err}{self._culprits(links)}") from err
            self.online.observe(part, self._tokens() - tokens, time.perf_counter() - t0)
            self._teach(part, loops, links.replica_comm)
            done += stepper.jobs_done
            left += stepper.jobs_left
            if left:  # the replica agreed to stop (the same vote on each of its stages)
                return done, left + sum(len(later) for later in parts[g + 1 :])
            if g + 1 < len(parts):  # a phase's timing is its own: the next starts after it
                req = links.replica_comm.Ibarrier()
                self._replica_wait(loops)(req.Test, f"phase {g + 1} of replica {self.pl.replica} to end")
        return done, left

    def _on(self, route: tuple[int, ...] | None) -> Placement:
        """This rank's place on ``route`` (None: the whole hierarchy)."""
        return self.pl if route is None else self.pl.on_route(route)

    def _teach(self, part: list[Job], loops: list[StageLoop], comm) -> None:
        """The model-free stages that sat ``part`` out learn its outputs from the leader (the
        suffix drafter's job store grows with every prompt of the job, whichever plan decoded it:
        run/online.py compares the plans on a drafter that knows the job)."""
        taught = [s for s in sorted(self.cfg.hierarchy.model_free) if not part[0].runs_on(s)]
        outputs = self.collector.take() if self.collector is not None else []  # the leader's, every part
        if not taught or not (self.pl.is_last or self.pl.stage in taught):
            return
        wait = self._replica_wait(loops)
        if self.pl.is_last:
            reqs = [comm.isend(outputs, dest=s, tag=LEARN_TAG) for s in taught]
            wait(lambda: all(r.Test() for r in reqs), f"stages {taught} to take job {part[0].seq}'s outputs")
            return
        req = comm.irecv(source=self.pl.n_stages - 1, tag=LEARN_TAG)
        got: list = []
        wait(lambda: bool(got) or _received(req, got), f"job {part[0].seq}'s outputs")
        for output in got[0]:
            loops[0].model.learn(output, part[0].store_key)

    def _loops_for(self, route: tuple[int, ...] | None) -> list[StageLoop]:
        """The loops a job on ``route`` runs on this rank: the route's own where it has links of
        its own and this stage is on it; else the whole hierarchy's (AR's route, a stage that
        sits the job out)."""
        return self.route_loops.get(route, self.route_loops[None])

    def _all_loops(self) -> list[StageLoop]:
        return [loop for loops in self.route_loops.values() for loop in loops]

    def _waiter(self, loops: list[StageLoop], timeout_s: float | None = None) -> WaitFor:
        """``wait(done, what)``: until ``done()``, without spinning, taking in proposals (kept for
        their prompt) and beating on every slot; a StallError after ``timeout_s``
        (run.stall_timeout_s by default)."""

        def wait(done: Callable[[], bool], what: str) -> None:
            def passed() -> bool:
                for loop in loops:
                    loop.pump()
                return done()

            wait_until(passed, timeout_s or self.cfg.run.stall_timeout_s, what)

        return wait

    def _tokens(self) -> int:
        return self.collector.tokens if self.collector is not None else 0

    def _batched(self, slots: list[StageProcess]) -> BatchedStage:
        """A batched stage over ``slots``, each block of its slots' bookkeeping ringing every
        neighbour once (``Doorbell.held``)."""
        held = self.bell.held if self.bell is not None else nullcontext
        return BatchedStage(slots, PerfClock(), held=held)

    def _done(self) -> set[JobKey]:
        """What a resumed run already finished, read by rank 0 for every rank (an unreadable
        results file is raised on every rank, reported once)."""
        done = err = None
        if self.world.rank == 0 and self.cfg.run.resume:
            try:
                done = done_jobs(self.run_dir)
            except UserError as e:
                err = e
        done, err = self.comm.bcast((done, err), root=0)
        if err is not None:
            err.collective = True
            raise err
        return done or set()

    def _replica_wait(self, loops: list[StageLoop]) -> WaitFor:
        """``wait(done, what)`` for a collective of the replica this rank just joined: it rings
        the replica's other stages, and sleeps until they ring as they join (``drive``'s
        wait, host/doorbell.py), taking in proposals and beating meanwhile. A stage that sits a
        prompt out waits here through the prompt: polled every millisecond, it took CPU from the
        stages on the route (docs/notebook.md, "The online plan")."""

        def wait(done: Callable[[], bool], what: str) -> None:
            if self.bell is not None:
                for r in self.pl.peers:
                    self.bell.ring(r)
            collective = Collective(done, loops, what)
            drive(collective, self.cfg.run.stall_timeout_s, self.bell)

        return wait

    def _barrier(self, loops: list[StageLoop], what: str, comm=None, timeout_s: float | None = None) -> None:
        """A barrier of ``comm`` (the world's by default), waited for as ``_waiter`` waits."""
        req = (comm or self.comm).Ibarrier()
        self._waiter(loops, timeout_s)(req.Test, what)

    def _culprits(self, links: setup.Links) -> str:
        """Which peers of this replica stopped answering, judged by their heartbeats."""
        limit = self.cfg.run.stall_timeout_s / 2
        stale = []
        for s, r in enumerate(self.pl.replica_ranks()):
            age = links.window.heartbeat_age_s(r)
            if r != self.world.rank and age > limit:
                name = self.cfg.hierarchy.stages[s].name
                stale.append(
                    f"rank {r} (stage {s}, {name}) stopped answering: last heartbeat {age:.0f} s ago"
                )
        return "; " + "; ".join(stale) if stale else "; no peer's heartbeat is stale (a slow forward?)"
