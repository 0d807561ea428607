"""Discrete-event simulation of AR, SD and PipeSpec over k stages, driving the real stage loop.

inputs.py       LatencyProfile (forward cost by tokens and context), Acceptance, SimConfig
oracle.py       oracle models (token agreement at set rates or along recorded traces)
engine.py       the timed engine: when each stage's real StageLoop steps
ports.py        the timed window and channels (delays, blocking reads)
traces.py       what a run recorded, read as simulator inputs (profiles, traces, latencies)
fit.py          RunFit: simulator inputs fitted from a run directory; predict a run's ms/token
paper.py        the paper's setting (profiles, acceptance traces, reported results)
explore/        the schedule explorer: the same loop under adversarial schedules
cli.py          ``pipespec-simulate`` (docs/simulator.md)
"""

from pipespec_mpi.simulate.engine import SimResult, mean_ms_per_token, simulate
from pipespec_mpi.simulate.inputs import Acceptance, LatencyProfile, SimConfig

__all__ = ["Acceptance", "LatencyProfile", "SimConfig", "SimResult", "mean_ms_per_token", "simulate"]
