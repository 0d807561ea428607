"""What the simulator is told: forward costs per stage, acceptance per pair, the run's settings."""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field

from pipespec_mpi.config import METHODS, DecodeConfig, StageConfig


@dataclass(frozen=True)
class LatencyProfile:
    """Time of one stage's forward over n tokens at context length ctx (seconds).

    forward_s(n, ctx) = interp(points, n) + per_ctx_s * (ctx - ctx_ref), where ``points`` are
    (n, seconds) pairs, linearly interpolated and extrapolated with the last segment's slope (a
    single point means a flat profile). ``overhead_s`` is the loop's own cost after each action;
    with ``overhead_draws`` (gaps observed in a run) each action's cost is drawn from them instead
    (a rank that shares its cores is now and then descheduled for milliseconds: a mean charged
    after every action would miss that it then finds more proposals waiting).
    kind="lookup" is a model-free drafter proposing up to ``max_proposal`` tokens per call, each
    call finding a continuation with probability ``lookup_hit_rate``, or ``lookup_chain_rate``
    (default: the same) when it continues its own previous proposal (copying from the same source,
    a real lookup usually finds the next n-gram too).
    """

    name: str = "stage"
    points: tuple[tuple[float, float], ...] = ((1.0, 0.01),)
    per_ctx_s: float = 0.0
    ctx_ref: float = 0.0
    overhead_s: float = 0.0
    overhead_draws: tuple[float, ...] = ()
    prefill_base_s: float = 0.0
    prefill_per_token_s: float = 0.0
    kind: str = "model"
    max_proposal: int = StageConfig.max_proposal  # as a prompt-lookup stage proposes
    lookup_hit_rate: float = 1.0
    lookup_chain_rate: float | None = None
    # a batched forward over m sequences costs forward_s(all their tokens) + (m - 1) * this:
    # attention, RoPE and the KV cache are per sequence, so m sequences cost more than m rows of
    # one (docs/notebook.md, "Measurements behind the code's choices")
    per_sequence_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError(f"{self.name}: a latency profile needs at least one (n, s) point")
        pts = tuple(sorted((float(n), float(s)) for n, s in self.points))
        object.__setattr__(self, "points", pts)

    @classmethod
    def linear(cls, name: str, one_token_s: float, per_extra_token_s: float = 0.0, **kw) -> LatencyProfile:
        pts = ((1.0, one_token_s), (2.0, one_token_s + per_extra_token_s))
        return cls(name=name, points=pts, **kw)

    def forward_s(self, n: int, ctx: float = 0.0) -> float:
        pts = self.points
        if len(pts) == 1:
            t = pts[0][1]
        else:
            i = bisect.bisect_left([p[0] for p in pts], n)
            i = min(max(i, 1), len(pts) - 1)
            (n0, t0), (n1, t1) = pts[i - 1], pts[i]
            t = t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        t += self.per_ctx_s * (ctx - self.ctx_ref)
        return max(t, 0.0)

    def prefill_s(self, n_prompt: int) -> float:
        return max(0.0, self.prefill_base_s + self.prefill_per_token_s * n_prompt)


@dataclass(frozen=True)
class Acceptance:
    """Acceptance between adjacent stages: per-pair i.i.d. rates, optionally recorded traces
    (per pair: output position -> did the drafter's token agree with the verifier's)."""

    rates: tuple[float, ...]
    traces: tuple[Mapping[int, bool] | None, ...] = ()
    # a lookup stage 0 on the target's output path: position -> proposal length (0: a miss),
    # as the run's lookup did there; other positions draw hits from ``lookup_hit_rate``
    lookup: Mapping[int, int] | None = None


@dataclass(frozen=True)
class SimConfig:
    """One simulated prompt: the method, the stage loop's own settings (``decode``; SD's window is
    ``decode.sd_window``, or ``decode.lookahead`` when that is None), and what the simulator adds."""

    method: str = "pipespec"
    decode: DecodeConfig = field(default_factory=lambda: DecodeConfig(max_new_tokens=128, sd_window=None))
    prompt_len: int = 0
    # per adjacent pair (i, i+1): delay of proposals i -> i+1 and of i+1's header seen by i
    # (and of i's header seen by i+1); a float applies to every pair. up_latency_s, when given,
    # overrides the direction downstream -> upstream (headers: epochs, SD demand).
    latency_s: float | tuple[float, ...] = 0.0
    up_latency_s: float | tuple[float, ...] | None = None
    # header reads (rollback epochs, SD demand, idle flags) wait while the stage being read is
    # inside a forward: MPI passive-target RMA progresses only when the target calls into MPI
    # (MPICH without asynchronous progress, run.epochs_window=rma). False: shared memory.
    blocking_reads: bool = False
    include_prefill: bool = True
    # replaying a recorded prompt: each stage's prefill time, and when it started relative to the
    # last stage (stages leave the start gate at different moments); None: the profiles, all at 0
    prefill_s: tuple[float, ...] | None = None
    start_s: tuple[float, ...] | None = None
    seed: int = 0
    record_timeline: bool = False
    max_events: int = 5_000_000
    batch_size: int = 1  # prompts decoded at once, each stage's forwards batched (engine.py)

    def __post_init__(self) -> None:
        d = self.decode
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: must be one of {METHODS}")
        if self.method == "sd" and d.window("sd") < 1:
            raise ValueError(f"method=sd needs a window >= 1 (decode.lookahead={d.lookahead}, "
                             f"decode.sd_window={d.sd_window})")  # fmt: skip
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: must be >= 1")
        if d.max_new_tokens < 1 or d.max_verify < 1 or d.max_run_ahead < 1:
            raise ValueError(f"decode.max_new_tokens={d.max_new_tokens}, max_verify={d.max_verify} and "
                             f"max_run_ahead={d.max_run_ahead} must be >= 1")  # fmt: skip
