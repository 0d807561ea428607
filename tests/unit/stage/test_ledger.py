"""The ledger prices what a rollback threw away and tells the policy each drafted token's fate once."""

from __future__ import annotations

from pipespec_mpi.stage.ledger import Ledger


class Fates:
    def __init__(self) -> None:
        self.told: list[tuple[int, bool]] = []

    def fate(self, ahead: int, kept: bool) -> None:
        self.told.append((ahead, kept))


def test_a_rollback_prices_the_tokens_it_threw_away():
    led = Ledger()
    led.committed(0, 0, 2, cost_s=1.0)  # two tokens in one forward: 0.5 s each
    led.committed(2, 1, 1, cost_s=0.25)
    assert led.ahead == [1, 2, 2] and led.cost == [0.5, 0.5, 0.25]
    assert led.adopted(keep=1, length=3) == 0.75  # ours after the first thrown away
    assert led.ahead == [1, 0, 0] and led.cost == [0.5, 0.0, 0.0]  # theirs: not ahead, free


def test_each_token_s_fate_is_told_once_and_adopted_ones_never():
    led, policy = Ledger(), Fates()
    led.committed(0, 0, 4, cost_s=1.0)  # ahead 1..4
    led.judged(policy, keep=4, confirmed=2)  # the downstream holds our first two
    assert policy.told == [(1, True), (2, True)]
    led.judged(policy, keep=4, confirmed=2)  # read again: nothing new
    assert len(policy.told) == 2
    led.judged(policy, keep=3, confirmed=3, thrown_to=4)  # a rollback kept 3 of our 4
    assert policy.told[2:] == [(3, True), (4, False)]
    led.adopted(keep=3, length=5)
    led.judged(policy, keep=5, confirmed=5)  # the two adopted from the downstream: no fate
    assert len(policy.told) == 4
