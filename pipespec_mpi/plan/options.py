"""The planner's vocabulary: a ``Setting`` (how a pipeline decodes), an ``Option`` (a setting on a
pipeline, predicted), the ``Grid`` of settings every planner searches, and a ``Plan`` (the choice
and why)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.config.schema import Policy


@dataclass(frozen=True)
class Setting:
    """How a pipeline decodes: the method and what each method reads of ``decode``."""

    method: str  # ar | sd | pipespec
    window: int = 0  # SD's window (decode.sd_window) or PipeSpec's lookahead; 0 for AR and adaptive
    run_ahead: int = 0  # PipeSpec's decode.max_run_ahead (0: the configured one)
    policy: Policy = Policy.static  # PipeSpec's decode.policy
    batch_size: int = 1

    def decode(self, base: DecodeConfig) -> DecodeConfig:
        """``base`` with this setting applied: the one place an option becomes decode config."""
        d = base
        if self.method == "sd":
            d = replace(d, sd_window=self.window)
        elif self.method == "pipespec":
            d = replace(d, lookahead=self.window, max_run_ahead=self.run_ahead or d.max_run_ahead,
                        policy=self.policy)  # fmt: skip
        return d.for_batch(self.batch_size) if self.batch_size > 1 else d


@dataclass(frozen=True)
class Option:
    """A setting on a pipeline (stage names, the target last), with its prediction."""

    method: str
    pipeline: tuple[str, ...]
    window: int
    ms_per_token: float  # batched: 1000 / tokens/s of all the batch's sequences
    speedup: float  # over AR at batch 1
    run_ahead: int = 0
    batch_size: int = 1
    policy: Policy = Policy.static

    @property
    def setting(self) -> Setting:
        return Setting(self.method, self.window, self.run_ahead, self.policy, self.batch_size)

    @classmethod
    def of(cls, setting: Setting, pipeline: tuple[str, ...], ms: float, ar_ms: float) -> Option:
        run_ahead = setting.run_ahead if setting.method == "pipespec" else 0
        return cls(setting.method, pipeline, setting.window, ms, ar_ms / ms, run_ahead, setting.batch_size,
                   setting.policy)  # fmt: skip


@dataclass(frozen=True)
class Grid:
    """The settings searched for every candidate pipeline. One grid for every planner:
    ``hierarchy=auto`` and ``pipespec-plan --measure`` widen the run-ahead (``AUTO_GRID``), the
    command line may narrow any axis."""

    lookaheads: tuple[int, ...] = (0, 1, 2, 4, 8)
    sd_windows: tuple[int, ...] = (1, 2, 3, 4, 6, 8)
    run_aheads: tuple[int, ...] = (0,)  # 0: the configured decode.max_run_ahead
    adaptive: bool = True  # PipeSpec under decode.policy=adaptive too (one per run-ahead)
    batch_sizes: tuple[int, ...] = (1,)

    def settings(self, decode: DecodeConfig) -> list[Setting]:
        """The batch-1 settings ``decode``'s bounds allow: a window never above max_verify nor
        the run-ahead (SD's never above decode.max_run_ahead)."""
        out = [
            Setting("sd", w) for w in self.sd_windows if w <= decode.max_verify and w <= decode.max_run_ahead
        ]
        for r in self.run_aheads:
            ahead = r or decode.max_run_ahead
            out += [
                Setting("pipespec", la, r)
                for la in self.lookaheads
                if la <= decode.max_verify and la <= ahead
            ]
            if self.adaptive:
                out.append(Setting("pipespec", 0, r, Policy.adaptive))
        return out


AUTO_GRID = Grid(lookaheads=(0, 1, 2, 4), sd_windows=(1, 2, 3, 4, 6), run_aheads=(4, 8, 16))


@dataclass(frozen=True)
class Plan:
    """The choice and why: the options tried (best first), the predicted AR, the margin."""

    chosen: Option
    best_speculative: Option | None
    ar: Option
    margin: float
    reason: str
    options: tuple[Option, ...] = field(default=())
    threads: Mapping[int, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d["threads"] = {str(k): v for k, v in self.threads.items()}
        return d

    def best(self, top: int) -> dict[str, list[Option]]:
        """The ``top`` fastest options of each method (batch 1), AR first."""
        out: dict[str, list[Option]] = {}
        for m in ("ar", "sd", "pipespec"):
            out[m] = [o for o in self.options if o.method == m and o.batch_size == 1][:top]
        return out
