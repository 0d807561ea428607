"""The schedule explorer: the real stage loop under seeded, adversarial schedules.

Every stage of one replica is a ``StageProcess`` (stage/process.py: reset, start gate, decode,
handoff, next prompt) over a ``StageLoop`` with an oracle model, exactly as a rank runs it; only
the ports differ. A seeded scheduler decides, tick by tick, which stage steps and when each
message becomes deliverable (FIFO per link, as MPI orders point-to-point messages), which version
of a neighbour's header a read sees (never older than what that reader saw before), when the
start gate lets each stage through and when a handoff is taken. Schedules are adversarial on
purpose: stages of very different speeds, one stage starved for long windows, a link's messages
held back and delivered in a burst, stale reads, send buffers that fill up. A quarter of the
scenarios also ask the replica to stop early (run/drain.py), its stages asking before different
jobs: the vote at the start gate must stop all of them before the same job, none started after.

A run fails when
  stall      nothing can move: every stage waits although every message was delivered, every
             read sees the newest header and every gate and handoff is released
  livelock   the schedule exceeds its tick budget
  error      an exception (a protocol invariant, a stale KV cache, a missing distribution, ...)
  mismatch   greedy or Gumbel output differs from the target decoding alone (AR), token for token
  counter    a stage's counters do not add up (tokens generated + adopted - discarded = kept, ...),
             or after a stop request a stage started a job, or the stages disagree on jobs left
  unrung     a stage moved although nothing it reads changed since its step that waited (every
             read fresh, no recheck due): a rank asleep on its doorbell (host/doorbell.py) would
             have slept through that change (not checked in the chaos families, whose drawn
             estimates change decisions with nothing changed)

A scenario (configuration plus schedule) is a pure function of its family and seed, so every
failure replays: ``pipespec-explore --replay FAMILY:SEED``.

  pipespec-explore --count 10000 --jobs 2      # every family
  pipespec-explore --families pipespec-leviathan --count 200

  scenarios.py  families, Scenario.draw(family, seed), presets, Finding
  ports.py      the explorer's clocks and ports (window, links, gate, handoff)
  world.py      World: one schedule run and judged; explore(family, seed)
  cli.py        sweep over families and seeds; the command line
"""

from pipespec_mpi.simulate.explore.cli import Tally, main, sweep
from pipespec_mpi.simulate.explore.ports import ExGate
from pipespec_mpi.simulate.explore.scenarios import FAMILIES, Finding, Parts, Scenario
from pipespec_mpi.simulate.explore.world import World, explore

__all__ = ["FAMILIES", "ExGate", "Finding", "Parts", "Scenario", "Tally", "World", "explore", "main", "sweep"]
