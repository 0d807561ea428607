"""One rank of a start-up probe: what a job does before its first prompt across hosts, without a
model (MPI, the rendezvous, the channels, the epochs window and the doorbell, as run/setup.py opens
them), logged to ``RUN_DIR/rank<r>.log`` as a job logs its start-up.

    mpirun -n 3 python tests/multihost/startup_probe.py RUN_DIR [OVERRIDES]

Run by tests/multihost/test_startup.py and bench/startup_stress.py; rank 0 prints ``probe:
start-up done`` once every rank is through.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path


def probe_rank(run_dir: Path, overrides: list[str]) -> None:
    """The start-up of one rank without a model: MPI, the rendezvous, the channels, the epochs
    window and the doorbell, under the start-up watchdog, logged to ``run_dir/rank<r>.log``."""
    import faulthandler
    import logging

    from pipespec_mpi.comm.bootstrap import shutdown_torch_distributed, world_info
    from pipespec_mpi.config import compose_config
    from pipespec_mpi.host.wait import sleep_at_barrier
    from pipespec_mpi.platforms import current_platform
    from pipespec_mpi.run import setup
    from pipespec_mpi.run.startup import StartupWatchdog
    from pipespec_mpi.topology import place

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the stress loop's stack dump
    world = world_info()
    logging.basicConfig(
        filename=run_dir / f"rank{world.rank}.log", level=logging.INFO,
        format=f"[%(asctime)s][rank {world.rank}][%(name)s][%(levelname)s] %(message)s",
    )  # fmt: skip
    cfg = compose_config(overrides)
    pl = place(world.rank, world.size, cfg.hierarchy.n_stages)
    watchdog = StartupWatchdog(cfg.run.startup_timeout_s, world.rank, world.hosts)
    seam = current_platform().resolve(cfg, world)
    p2p = setup.rendezvous(cfg, world, seam.transport, watchdog)
    loaded = setup.Loaded(
        seam=seam, p2p=p2p, cpus=None, tokenizer=None, feed=None, n_prompts=0, bad=[], row_error=None,
        sampled=False, model=None, engines=[], seams=[], vocab=0, gpu_monitor=None,
    )  # fmt: skip
    with watchdog.phase("channels and windows"):
        links = setup.connect(cfg, world, pl, loaded)
        setup.open_doorbell(cfg, world, pl, loaded, links.window.kind)
    watchdog.close()
    sleep_at_barrier(world.comm)
    links.close(cfg.run.stall_timeout_s)
    shutdown_torch_distributed()
    if world.rank == 0:
        print("probe: start-up done", flush=True)


if __name__ == "__main__":
    probe_rank(Path(sys.argv[1]), sys.argv[2:])
