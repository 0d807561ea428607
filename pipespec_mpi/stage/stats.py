"""What a stage records about one prompt (one per stage in every line of results.jsonl)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipespec_mpi.speculative.policy import ChoiceCounts


class CountError(AssertionError):
    """A stage's counters contradict what it holds (a bug, never a user error)."""


@dataclass
class StageStats:
    stage: int
    """the stage's index in the hierarchy"""
    rank: int
    """its MPI rank"""
    model: str
    """its model's name"""
    forward_calls: int = 0
    """forwards it ran (steps, verifications, catch-ups; not the prefill)"""
    draft_steps: int = 0
    """one-token steps (or model-free lookups that found a draft) that drafted"""
    own_steps: int = 0
    """a verifier's one-token steps of its own (nothing to verify)"""
    verifications: int = 0
    """forwards that verified proposals"""
    tokens_proposed: int = 0
    """tokens this stage sent downstream (a resend counts again)"""
    tokens_verified: int = 0
    """proposal tokens this stage checked"""
    tokens_accepted: int = 0
    """proposal tokens this stage accepted"""
    tokens_generated: int = 0
    """tokens committed by this stage's own actions"""
    tokens_adopted: int = 0
    """tokens taken over from the downstream's committed tokens"""
    rollbacks: int = 0
    """times this stage was rolled back by its downstream"""
    rollbacks_signalled: int = 0
    """epoch bumps (rollbacks this stage asked upstream for)"""
    tokens_discarded: int = 0
    """own tokens thrown away by rollbacks"""
    discarded_s: float = 0.0
    """compute time spent on those tokens"""
    dropped_messages: int = 0
    """proposals of an old epoch or prompt"""
    waits_chosen: int = 0
    """the adaptive policy's waits for more proposals although it could act"""
    waits_joined: int = 0
    """its waits given up to join the stage's batched forward (stage/batch.py)"""
    verify_cut: int = 0
    """its verifications of fewer proposals than were pending"""
    drafts_held: int = 0
    """its holds of a model drafter by survival (decode.draft_survival)"""
    policy_state: dict = field(default_factory=dict)
    """adaptive: its estimates at the end (goodput.py)"""
    busy_s: float = 0.0
    """seconds computing (forwards, lookups)"""
    wait_s: float = 0.0
    """seconds waiting for a message or a rollback"""
    read_s: float = 0.0
    """in epochs-window reads (a passive-target RMA read waits for a busy owner)"""
    prefill_s: float = 0.0
    """the prompt's prefill"""
    t0_perf_counter: float = 0.0
    """this rank's clock at the prompt start (one clock for the processes of a node; timeline times are
    relative to it)"""
    verify_trace: list[list[int]] = field(default_factory=list)
    """[n_proposed, n_accepted]"""
    timeline: list[list] = field(default_factory=list)
    """[t0, t1, kind, n_tokens, context]"""
    commit_times: list[list[float]] = field(default_factory=list)
    """[t, n_committed] (last stage)"""
    peak_rss_mb: float = 0.0
    """this rank's peak resident memory so far"""
    cpu_start_s: float = 0.0
    """this rank's process CPU seconds (every thread: time.process_time) when the prompt started on it and
    when it handed its stats over, and its clock then (as ``t0_perf_counter``): the cores it kept busy
    meanwhile, computing or not (``StageSummary.cpu_cores``)"""
    cpu_end_s: float = 0.0
    """see ``cpu_start_s``"""
    t1_perf_counter: float = 0.0
    """see ``cpu_start_s``"""
    threads: int = 0
    """the CPU threads this rank computes with (its share of the node's cores)"""
    cpus: list[int] | None = None
    """the CPUs it was bound to (run.cpu_bind); None: as launched"""
    cores: float | None = None
    """the node's CPUs it accounts for in a cost (host/placement.py CpuShare.cores)"""
    n_gpus: int = 0
    """the GPUs it holds"""
    bytes_sent: int = 0
    """proposal bytes sent downstream (ids, and distributions when sampling)"""
    drafter: dict = field(default_factory=dict)
    """a model-free stage 0's own counters (models/suffix.py)"""
    gpus: list[dict] = field(default_factory=list)
    """NVML per device: energy_j, util_mean, mem_peak_mb"""

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def prefilled(self, seconds: float) -> None:
        """The prompt's prefill took ``seconds``."""
        self.prefill_s = seconds

    def drafted(self, report: dict) -> None:
        """A model-free drafter's own counters at the prompt's end (models/suffix.py)."""
        self.drafter = report

    def looked_up(self, seconds: float, n: int) -> None:
        """A model-free drafter's lookup that took ``seconds`` and found ``n`` tokens (0: a miss)."""
        self.busy_s += seconds
        if n:
            self.draft_steps += 1

    def proposed(self, n: int, n_bytes: int) -> None:
        """``n`` tokens sent downstream in ``n_bytes`` (a resend counts again)."""
        self.tokens_proposed += n
        self.bytes_sent += n_bytes

    def dropped(self, n: int = 1) -> None:
        """Proposals of an old epoch or prompt dropped."""
        self.dropped_messages += n

    def read(self, seconds: float) -> None:
        """An epochs-window read that took ``seconds``."""
        self.read_s += seconds

    def signalled_rollback(self) -> None:
        """This stage bumped its epoch: its upstream rolls back."""
        self.rollbacks_signalled += 1

    def stepped(self, kind: str) -> None:
        """A one-token forward of its own: a drafter's ``draft`` step or a verifier's ``own`` one."""
        self.forward_calls += 1
        if kind == "draft":
            self.draft_steps += 1
        else:
            self.own_steps += 1

    def chose(self, counts: ChoiceCounts, state: dict) -> None:
        """The policy's report at the prompt's end: its own choices, and what it has learned."""
        for name, value in asdict(counts).items():
            setattr(self, name, value)
        self.policy_state = state

    def verified(self, n: int, accepted: int) -> None:
        """A verification of ``n`` proposals, ``accepted`` of them kept."""
        if not 0 <= accepted <= n:
            raise CountError(f"stage {self.stage}: {accepted} of {n} proposals accepted")
        self.forward_calls += 1
        self.verifications += 1
        self.tokens_verified += n
        self.tokens_accepted += accepted
        self.verify_trace.append([n, accepted])

    def committed(self, n: int, length: int) -> None:
        """``n`` tokens committed by the stage's own action; its sequence is now ``length`` long."""
        self.tokens_generated += n
        self._balanced(length)

    def adopted(self, keep: int, old: int, length: int, discarded_s: float) -> None:
        """The downstream's tokens taken over: ours kept up to ``keep`` of ``old``, the rest thrown
        away (``discarded_s`` of compute); the sequence is now ``length`` long."""
        if not 0 <= keep <= min(old, length):
            raise CountError(f"stage {self.stage}: kept {keep} of {old} tokens, now holding {length}")
        if old > keep:
            self.rollbacks += 1
            self.tokens_discarded += old - keep
            self.discarded_s += discarded_s
        self.tokens_adopted += length - keep
        self._balanced(length)

    def _balanced(self, length: int) -> None:
        """Every token the stage holds was generated or adopted, and not thrown away: live, so a
        bookkeeping slip fails at the step that made it (the explorer reports it as an error)."""
        if self.token_balance(length):
            raise CountError(
                f"stage {self.stage}: generated {self.tokens_generated} + adopted {self.tokens_adopted} "
                f"- discarded {self.tokens_discarded} != {length} tokens held"
            )

    def token_balance(self, final: int) -> int:
        """generated + adopted - discarded - final: zero when no token is lost or counted twice."""
        return self.tokens_generated + self.tokens_adopted - self.tokens_discarded - final


class Trace:
    """Where a stage's time goes on one prompt, kept in its ``StageStats``: busy and waiting,
    and (``record``) a timeline of its prefill, forwards and waits from the prompt's start."""

    def __init__(self, stats: StageStats, record: bool) -> None:
        self.stats, self.record = stats, record
        self.t_start = 0.0
        self.wait_t0: float | None = None  # when the current wait began (None: not waiting)

    def start(self, t: float) -> None:
        """The prompt starts at ``t`` on the stage's clock."""
        self.t_start = self.stats.t0_perf_counter = t

    def event(self, t0: float, t1: float, kind: str, n: int, context: int) -> None:
        """A span of ``kind`` over ``n`` tokens, the sequence ``context`` long at its end."""
        if self.record:
            self.stats.timeline.append([round(t0 - self.t_start, 6), round(t1 - self.t_start, 6),
                                        kind, n, context])  # fmt: skip

    def busy(self, t0: float, t1: float, kind: str, n: int, context: int) -> None:
        """A forward from ``t0`` to ``t1``."""
        self.stats.busy_s += t1 - t0
        self.event(t0, t1, kind, n, context)

    def wait_from(self, t: float) -> None:
        """The stage waits since ``t`` unless it already did."""
        if self.wait_t0 is None:
            self.wait_t0 = t

    def wait_ends(self, t: float, context: int) -> None:
        if self.wait_t0 is not None:
            self.stats.wait_s += t - self.wait_t0
            self.event(self.wait_t0, t, "wait", 0, context)
            self.wait_t0 = None

    def committed(self, t: float, length: int) -> None:
        """The last stage's sequence reached ``length`` tokens at ``t``."""
        self.stats.commit_times.append([round(t - self.t_start, 6), length])


@dataclass
class StageOutcome:
    tokens: list[int]
    finish_reason: str  # eos | length (the last stage), done (relayed), idle (not in this method)
    wall_s: float  # from the start of the prompt (prefill included) to its end on this stage
    stats: StageStats
