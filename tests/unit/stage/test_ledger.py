"""The ledger prices what a rollback threw away and gives each drafted token's fate once."""

from __future__ import annotations

from pipespec_mpi.stage.ledger import Ledger


def test_a_rollback_prices_the_tokens_it_threw_away():
    led = Ledger()
    led.committed(0, 0, 2, cost_s=1.0)  # two tokens in one forward: 0.5 s each
    led.committed(2, 1, 1, cost_s=0.25)
    assert led.ahead == [1, 2, 2] and led.cost == [0.5, 0.5, 0.25]
    assert led.adopted(keep=1, length=3) == 0.75  # ours after the first thrown away
    assert led.ahead == [1, 0, 0] and led.cost == [0.5, 0.0, 0.0]  # theirs: not ahead, free


def test_each_token_s_fate_is_given_once_and_adopted_ones_never():
    led = Ledger()
    led.committed(0, 0, 4, cost_s=1.0)  # ahead 1..4
    assert led.judged(keep=4, confirmed=2) == [(1, True), (2, True)]  # the downstream holds two
    assert led.judged(keep=4, confirmed=2) == []  # read again: nothing new
    assert led.judged(keep=3, confirmed=3, thrown_to=4) == [(3, True), (4, False)]  # a rollback kept 3
    led.adopted(keep=3, length=5)
    assert led.judged(keep=5, confirmed=5) == []  # the two adopted from the downstream: no fate
