"""Entry point: ``mpirun -n 3 python -m pipespec_mpi [hydra overrides]``.

Thin on purpose: MPI first (rank 0 picks the run's time stamp and broadcasts it, so every rank
resolves the same Hydra run directory), then Hydra composes the config, ``load_config`` types
and validates it, and ``Runner`` does the work. Any exception on any rank aborts the whole job.

A Hydra launcher that runs the task function in fresh processes (hydra-submitit-launcher: each
Slurm task unpickles ``app`` and Hydra's resolvers with this module's globals as the submitting
process left them) gets its MPI world from ``current_world()``, which sets the world up again in
any process that did not do it itself; the resolvers for the rank's log file and ``.hydra`` call it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from pipespec_mpi.comm.bootstrap import (
    abort,
    abort_job,
    check_singletons,
    shutdown_torch_distributed,
    world_info,
)
from pipespec_mpi.config import load_config, register
from pipespec_mpi.platforms import preflight
from pipespec_mpi.topology import check_world

WORLD = None  # this process's world, set by current_world(); read by the task function
_WORLD_OWNER: tuple[int, str] | None = None  # (pid, host) of the process that set WORLD up


def current_world():
    """This process's MPI world, set up on first use in each process (also a launcher's worker)."""
    global WORLD, _WORLD_OWNER
    owner = (os.getpid(), socket.gethostname())
    if WORLD is None or owner != _WORLD_OWNER:
        world = world_info()
        check_singletons(world)
        WORLD, _WORLD_OWNER = world, owner
        os.environ["PIPESPEC_RANK"] = str(world.rank)
    return WORLD


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def app(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    world = current_world()
    try:
        typed = load_config(cfg)
        preflight(typed, world)  # before any model loads
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        logger = logging.getLogger("pipespec_mpi")
        logger.setLevel(logging.INFO)  # every rank's rank*.log says what it is doing
        logger.filters.clear()
        if world.rank != 0:  # the console: rank 0's progress, everyone's warnings
            quiet_console(logging.WARNING)
        if typed.hierarchy.choose:
            code = run_auto(typed, run_dir, world, logger)
        else:
            code = run(typed, run_dir, world, logger)
    except BaseException as exc:  # noqa: BLE001 - one failing rank must take the job down
        from pipespec_mpi.comm.rendezvous import RendezvousError
        from pipespec_mpi.errors import UserError

        if isinstance(exc, UserError):
            user_error(exc, world)
        if isinstance(exc.__cause__, RendezvousError):  # names the step and who did not answer
            abort_job(str(exc), code=3)  # as the start-up watchdog does (run/startup.py)
        abort(exc, f"rank {world.rank} of {world.size} ({world.hostname})")
    if code:  # stopped early (run/drain.py): the same code on every rank, all leave together
        shutdown_torch_distributed()
        raise SystemExit(code)


def run(cfg, run_dir: Path, world, logger: logging.Logger) -> int:
    """The job on this rank; its exit code (non-zero when asked to stop early: run/drain.py)."""
    from pipespec_mpi.plan.memory import NodeMemory
    from pipespec_mpi.run import Runner

    n = cfg.hierarchy.n_stages
    logger.addFilter(StageTag(f"replica {world.rank // n} stage {world.rank % n}"))
    memory = NodeMemory(cfg, world) if cfg.online.remember and world.rank % n == n - 1 else None
    return Runner(cfg, run_dir, world, memory).run()


def run_auto(cfg, run_dir: Path, world, logger: logging.Logger) -> int:
    """``hierarchy=auto``: plan (plan/job.py), run the plan on the ranks it uses; every rank
    leaves together, with the job's exit code."""
    from pipespec_mpi.host.wait import sleep_at_barrier
    from pipespec_mpi.plan import job as plan_job
    from pipespec_mpi.plan.record import write_plan
    from pipespec_mpi.plan.refit import RefitMemory

    job = plan_job.resolve(cfg, world)
    if world.rank == 0:
        write_plan(run_dir, job.record)
    code = 0
    if job.world is not None:
        check_world(job.world.size, job.cfg.hierarchy.n_stages)
        code = run(job.cfg, run_dir, job.world, logger)
        if job.world.rank == 0:
            m = job.record.machine
            memory = RefitMemory(cfg, m.cores, m.ranks_on_node) if m is not None else None
            plan_job.add_measured(run_dir, job.record, cfg.auto.off_factor, memory)
        job.world.comm.Free()
    sleep_at_barrier(world.comm)  # with the spare ranks
    from mpi4py import MPI

    return world.comm.allreduce(code, op=MPI.MAX)


def quiet_console(level: int) -> None:
    """This rank's console handlers pass only records of ``level`` and above (its log file keeps
    everything)."""
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
            h.setLevel(level)


class StageTag(logging.Filter):
    """Prefix this rank's log records with its replica and stage (the format already has the rank)."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = f"[{self.tag}] {record.msg}"
        return True


def user_error(exc: BaseException, world) -> None:
    """Bad input: one message, no traceback, exit code 2 for the whole job.

    Config and world-size problems are found by every rank alike (rank 0 prints them and all
    exit together); others (a missing model, a bad dataset) only on some ranks, which then
    abort the job with their message.
    """
    from mpi4py import MPI

    from pipespec_mpi.config import ConfigError
    from pipespec_mpi.topology import TopologyError

    if isinstance(exc, (ConfigError, TopologyError)) or exc.collective:
        if world.rank == 0:
            sys.stderr.write(f"[pipespec_mpi] error: {exc}\n")
            sys.stderr.flush()
        MPI.COMM_WORLD.Barrier()
        os._exit(2)
    abort_job(f"[pipespec_mpi] error on rank {world.rank}: {exc}\n", code=2)


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps stacks
    # USR2 asks for a stop (run/drain.py, which handles it once the run starts); until then an
    # early one must not kill the rank (its default action). The sbatch scripts' STOP file stays.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        current_world()
        from mpi4py import MPI

        stamp = time.strftime("%Y-%m-%d/%H-%M-%S") if WORLD.rank == 0 else None
        stamp = MPI.COMM_WORLD.bcast(stamp, root=0)
    except BaseException as exc:  # noqa: BLE001
        abort(exc, "startup")
    os.environ.setdefault("PIPESPEC_RUN_STAMP", stamp)
    OmegaConf.register_new_resolver(
        "pipespec_output_subdir", lambda: ".hydra" if current_world().rank == 0 else None, replace=True
    )
    OmegaConf.register_new_resolver("pipespec_rank", lambda: current_world().rank, replace=True)
    register()  # the schema conf/config.yaml composes on
    app()
    shutdown_torch_distributed()


if __name__ == "__main__":
    main()
