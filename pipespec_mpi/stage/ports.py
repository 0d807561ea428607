"""The parts a stage loop is built from, as typed protocols.

The same ``StageLoop`` runs on an MPI rank (``comm/``: the epochs windows and proposal channels,
``time.perf_counter``, a transformers model), in the discrete-event simulator and under the
schedule explorer (``simulate/``: simulated clock, windows with read delays, channels with
latency, oracle models). Nothing in the loop knows which. The two messages the ports carry,
``Proposal`` and ``Header``, are defined here, the protocol's own vocabulary; ``comm/`` encodes
them for MPI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class ProtocolError(RuntimeError):
    """An invariant of the stage protocol broke (a bug, never a user error)."""


@dataclass(frozen=True)
class StageRole:
    """Where a stage sits: its index among ``n_stages``, its rank and its neighbours' ranks."""

    stage: int
    n_stages: int
    rank: int
    upstream: int | None
    downstream: int | None
    upstream_free: bool = False  # the upstream is a model-free drafter (prompt lookup, suffix)

    @property
    def is_last(self) -> bool:
        return self.downstream is None


@dataclass(frozen=True)
class Proposal:
    """Tokens a stage sends downstream: ``tokens`` from position ``start`` of prompt ``prompt``,
    drafted against the receiver's rollback ``epoch`` as the sender last saw it."""

    prompt: int
    epoch: int
    start: int
    tokens: list[int]
    dists: np.ndarray | None = None  # [count, V] float32: the distribution each token was drawn from
    slot: int = 0  # the receiving rank's sequence (slot) it is for: batched decoding over one link


@dataclass(frozen=True)
class Header:
    """What a stage publishes in the epochs window beside its committed tokens (the fields'
    meaning: comm/window.py's layout)."""

    prompt: int
    epoch: int
    length: int
    done: bool
    want: int
    idle: bool
    # the downstream's epoch and committed length as this stage had read them when it published:
    # what its idle flag is about (a flag published before the stage read the downstream's newest
    # tokens says nothing about them)
    down_epoch: int = 0
    down_length: int = 0


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a clock shared by the stages of one replica (timeline times, costs)."""


class Window(Protocol):
    """The epochs window: every stage publishes its header and committed tokens; neighbours read."""

    def publish(self, header: Header, tokens: Sequence[int], dirty_from: int) -> None:
        """Make ``header`` and ``tokens`` (header.length of them; those before ``dirty_from``
        unchanged since the last publish) what neighbours read."""

    def header(self, rank: int) -> Header: ...

    def snapshot(self, rank: int) -> tuple[Header, list[int]]:
        """Header and committed tokens of ``rank``, consistent with each other."""

    def beat(self) -> None:
        """Refresh this rank's heartbeat."""


class Sender(Protocol):
    bytes_sent: int

    def try_send(
        self, prompt: int, epoch: int, start: int, tokens: list[int], dists: np.ndarray | None = None
    ) -> int:
        """Post tokens for positions start.. without blocking; returns how many were posted (a
        prefix: the rest waits for a free send buffer)."""


class Receiver(Protocol):
    def poll(self) -> list[Proposal]:
        """Every proposal that has arrived, in sending order; never blocks."""


class Scorer(Protocol):
    """A causal LM with a KV cache that can be cut back to any length. It returns the logits for
    the positions after a committed sequence plus an optional proposal, in one forward."""

    name: str

    def prefill(self, prompt: Sequence[int], room: int = 0) -> None:
        """Start a new sequence: reset the cache and encode all but the last prompt token.

        ``room``: how many positions the sequence may grow beyond the prompt (sizes the cache).
        """

    def logits(self, seq: Sequence[int], proposal: Sequence[int]) -> torch.Tensor:
        """Logits [len(proposal)+1, V] for the positions after ``seq`` and each proposal prefix.

        ``seq`` is the full sequence (prompt + committed tokens); tokens not yet in the cache are
        encoded in the same forward. Afterwards the cache holds seq + proposal.
        """

    def truncate(self, length: int) -> None:
        """Cut the cache back to its first ``length`` positions (no-op if it is shorter)."""

    @property
    def backend(self) -> object:
        """What scorers whose forwards can run as one share (the slots of one engine): requests
        of scorers with the same backend go to one ``score_many``."""

    def score_many(
        self, requests: Sequence[tuple[Scorer, Sequence[int], Sequence[int]]]
    ) -> list[torch.Tensor]:
        """``scorer.logits(seq, proposal)`` of every request (their scorers share this one's
        backend), in as few forwards as the backend can."""


class Proposer(Protocol):
    """A model-free drafter (prompt lookup, suffix drafting) that proposes tokens from the text
    so far and what it has seen of the job."""

    name: str
    max_proposal: int

    def prefill(self, prompt: Sequence[int], room: int = 0, store_key: str = "") -> None:
        """Start a sequence; ``store_key`` names the job-level history it drafts from and
        joins (the stage loop passes the method)."""

    def propose(self, seq: Sequence[int], limit: int, confirmed: int | None = None) -> list[int]:
        """Up to ``limit`` draft tokens continuing ``seq`` (may be empty). ``confirmed``: how many
        leading tokens of ``seq`` the next stage has committed (what the drafter learns from)."""

    def end_sequence(self, output: Sequence[int]) -> dict:
        """The sequence is over with these committed tokens (as far as this stage knows them);
        returns the drafter's own counters for the stage's stats ({} if it keeps none)."""


@dataclass(frozen=True)
class StagePorts:
    """What a stage talks through: the epochs window, its clock, and the proposal channels to its
    downstream (``sender``) and from its upstream (``receiver``), None at the pipeline's ends."""

    window: Window
    clock: Clock
    sender: Sender | None = None
    receiver: Receiver | None = None
