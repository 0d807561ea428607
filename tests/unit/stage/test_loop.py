"""Pieces of the stage loop: the mailbox, the driver (the verifiers: speculative/test_verifiers.py)."""

from __future__ import annotations

import pytest
import torch

from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.host.wait import StallError
from pipespec_mpi.run.drive import drive
from pipespec_mpi.speculative.policy import Act
from pipespec_mpi.speculative.verifiers import Greedy
from pipespec_mpi.stage.loop import Forward, StageLoop, Step
from pipespec_mpi.stage.ports import Header, StagePorts, StageRole


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
    monkeypatch.setattr("pipespec_mpi.run.drive.time.monotonic", lambda: next(clock))
    monkeypatch.setattr("pipespec_mpi.host.wait.time.sleep", lambda s: None)
    # progress without a forward (tokens adopted, proposals taken) resets the stall timer
    drive(Script([Step.WAITING, Step.PROGRESS] * 20), stall_timeout_s=25)
    with pytest.raises(StallError, match="scripted stage: no progress for 25 s"):
        drive(Script([Step.WAITING] * 5), stall_timeout_s=25)


class HeaderBoard:
    """An epochs window as a dict of headers: the test sets what each neighbour published."""

    def __init__(self) -> None:
        self.headers: dict[int, Header] = {}

    def publish(self, header: Header, tokens, dirty_from: int) -> None:
        self.headers[1] = header

    def header(self, rank: int) -> Header:
        return self.headers.get(rank, Header(-1, 0, 0, False, 0, False))

    def snapshot(self, rank: int):
        raise AssertionError("the downstream never got ahead in this test")

    def beat(self) -> None:
        pass


class CountingScorer:
    """Logits that always pick token 7; the forwards asked for are counted by the test."""

    name = "middle"

    def prefill(self, prompt, room=0) -> None:
        pass

    def logits(self, seq, proposal) -> torch.Tensor:
        out = torch.zeros(len(proposal) + 1, 16)
        out[:, 7] = 1.0
        return out

    def truncate(self, length: int) -> None:
        pass


class Ticks:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        self.t += 1e-3
        return self.t


def test_a_drafter_drafts_from_the_job_store_its_job_names():
    """``begin``'s ``store_key`` picks the suffix drafter's job store (run/jobs.py ``Job.store_key``:
    one per method and batch size, and the warm-ups'); without one, the method's."""
    from pipespec_mpi.models.suffix import SuffixDrafter

    drafter = SuffixDrafter("suffix")
    role = StageRole(0, 2, rank=0, upstream=None, downstream=1)
    loop = StageLoop(role, drafter, StagePorts(HeaderBoard(), Ticks()), DecodeConfig(max_new_tokens=4), 0)
    for seq, key in ((1, "pipespec:warmup"), (2, "pipespec:b4"), (3, None)):
        loop.reset(seq)
        loop.begin([3, 4, 5], "pipespec", Greedy(), store_key=key)
    assert set(drafter.learned) == {"pipespec:warmup", "pipespec:b4", "pipespec"}
    assert drafter.store is drafter.learned["pipespec"][0]


def test_an_idle_flag_older_than_the_verifiers_last_token_is_not_believed():
    """The middle stage (static, ``wait_for_drafter``) steps on its own only when the drafter
    says it has nothing for the tokens as they are now: an idle flag published before the drafter
    read the middle stage's last token is about an older text, so it waits, even when the
    drafter's own unconfirmed drafts make its header longer than the middle stage's tokens."""
    board = HeaderBoard()
    cfg = DecodeConfig(policy="static", wait_for_drafter=True, max_new_tokens=8)
    role = StageRole(1, 3, rank=1, upstream=0, downstream=2, upstream_free=True)
    loop = StageLoop(role, CountingScorer(), StagePorts(board, Ticks()), cfg, eos_token_id=0)
    loop.reset(1)
    loop.begin([3, 4], "pipespec", Greedy())
    board.headers[2] = Header(1, 0, 0, False, 0, False)  # the target: started, nothing committed
    board.headers[0] = Header(1, 0, 0, False, 0, True)  # the drafter: nothing for the prompt
    fwd = loop.advance()
    assert isinstance(fwd, Forward) and fwd.act is Act.OWN
    loop.answer(fwd, loop.model.logits(fwd.seq, fwd.proposal), 0.0)
    assert loop.p.out == [7]
    assert loop.advance() is Step.WAITING  # the drafter's idle flag predates token 7
    # two drafted tokens of its own, then idle, still on the empty text it had read
    board.headers[0] = Header(1, 0, 2, False, 0, True, down_epoch=0, down_length=0)
    assert loop.advance() is Step.WAITING
    board.headers[0] = Header(1, 0, 2, False, 0, True, down_epoch=0, down_length=1)  # read token 7
    fwd = loop.advance()
    assert isinstance(fwd, Forward) and fwd.act is Act.OWN


def test_each_prompt_has_its_own_state_and_a_phase_changes_only_between_prompts():
    """``reset`` makes the prompt's ``PromptState`` (the one place the loop keeps what a prompt
    changes); the last prompt's is left as it ended; a phase change mid-prompt is refused."""
    board = HeaderBoard()
    cfg = DecodeConfig(policy="static", max_new_tokens=1)
    role = StageRole(0, 1, rank=0, upstream=None, downstream=None)
    loop = StageLoop(role, CountingScorer(), StagePorts(board, Ticks()), cfg, eos_token_id=0)
    assert loop.p is None
    loop.enter_phase(cfg)  # before any prompt: allowed
    first = loop.reset(1)
    assert first is loop.p and (first.seq, first.epoch, first.out) == (1, 0, [])
    loop.begin([3, 4], "ar", Greedy())
    with pytest.raises(RuntimeError, match="a phase change with prompt 1 in flight"):
        loop.enter_phase(cfg)
    while (s := loop.step()) is not Step.DONE:
        assert s is not Step.WAITING
    assert loop.finish().tokens == first.out == [7]
    loop.enter_phase(cfg)
    second = loop.reset(2)
    assert second is not first and second.out == [] and first.out == [7] and first.finish_reason == "length"
