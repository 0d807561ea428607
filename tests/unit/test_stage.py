"""Pieces of the stage loop: the mailbox, the driver, the verifiers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipespec_mpi.config import SamplingConfig
from pipespec_mpi.speculative.sampling import Sampler
from pipespec_mpi.speculative.verifiers import AcceptAll, Greedy, Gumbel, Leviathan, make_verifier
from pipespec_mpi.stage.loop import Mailbox, Step
from pipespec_mpi.stage.ports import Proposal
from pipespec_mpi.stage.process import drive
from pipespec_mpi.stage.wait import StallError


class ListReceiver:
    def __init__(self, msgs):
        self.msgs = list(msgs)

    def poll(self):
        out, self.msgs = self.msgs, []
        return out


def msg(prompt: int, start: int = 0) -> Proposal:
    return Proposal(prompt, 0, start, [1])


def test_mailbox_keeps_proposals_of_a_prompt_not_started_yet():
    box = Mailbox(ListReceiver([msg(1), msg(2), msg(3, 0), msg(3, 1)]))
    box.pump()  # while waiting at the gate of prompt 2
    mine, dropped = box.take(2)
    assert [m.prompt for m in mine] == [2] and dropped == 1
    mine, dropped = box.take(3)
    assert [m.start for m in mine] == [0, 1] and dropped == 0


class Script:
    """A steppable that replays a list of steps, then says DONE."""

    def __init__(self, steps):
        self.steps = list(steps)

    def step(self):
        return self.steps.pop(0) if self.steps else Step.DONE

    def describe(self):
        return "scripted stage"


def test_drive_keeps_going_while_something_moves(monkeypatch):
    clock = iter(range(0, 10_000, 10))  # every monotonic() call: 10 s later
    monkeypatch.setattr("pipespec_mpi.stage.process.time.monotonic", lambda: next(clock))
    monkeypatch.setattr("pipespec_mpi.stage.wait.time.sleep", lambda s: None)
    # progress without a forward (tokens adopted, proposals taken) resets the stall timer
    drive(Script([Step.WAITING, Step.PROGRESS] * 20), stall_timeout_s=25)
    with pytest.raises(StallError, match="scripted stage: no progress for 25 s"):
        drive(Script([Step.WAITING] * 5), stall_timeout_s=25)


def test_rules_by_sampler():
    assert isinstance(make_verifier(Sampler(), 0), Greedy)
    assert isinstance(make_verifier(Sampler(SamplingConfig(temperature=1.0, coupling="gumbel")), 0), Gumbel)
    lev = make_verifier(Sampler(SamplingConfig(temperature=1.0)), 1)
    assert isinstance(lev, Leviathan) and lev.carries_dists and not lev.resendable


def test_greedy_verification_accepts_its_own_argmax_prefix():
    logits = torch.zeros(4, 5)
    for j, tok in enumerate([3, 1, 4, 2]):
        logits[j, tok] = 1.0
    v = Greedy().verify([3, 1, 0], None, logits, 0).verdict
    assert (v.n_accepted, v.next_token) == (2, 4)


def test_leviathan_returns_the_distribution_of_every_committed_token():
    torch.manual_seed(0)
    logits = torch.randn(3, 6)
    lev = Leviathan(Sampler(SamplingConfig(temperature=1.0), key=5), 1)
    q = [np.full(6, 1 / 6, dtype=np.float32)] * 2
    c = lev.verify([2, 4], q, logits, 0)
    assert len(c.dists) == c.verdict.n_accepted + 1
    with pytest.raises(ValueError, match="distribution"):
        lev.verify([2, 4], None, logits, 0)


def test_accept_all_accepts_everything():
    logits = torch.zeros(3, 5)
    logits[2, 4] = 1.0
    v = AcceptAll(Greedy()).verify([0, 0], None, logits, 0).verdict
    assert (v.n_accepted, v.next_token) == (2, 4)
