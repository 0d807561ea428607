"""The online plan's bandit on recorded timings (run/online.py): a plan that measures faster is
adopted, noise within the margin does not flap, re-checks catch a drift, a remembered estimate
skips the exploration; and the arms and routes it chooses among."""

from __future__ import annotations

import random

import pytest

from pipespec_mpi.config import OnlineConfig
from pipespec_mpi.run.online import Arm, OnlinePlan, arms

AR = Arm("ar", (2,))
FULL = Arm("pipespec", (0, 1, 2))
SKIP = Arm("pipespec", (0, 2))
ARMS = [FULL, SKIP, AR]


def run(plan: OnlinePlan, ms: dict[Arm, float] | callable, n: int, rng=None) -> list[Arm]:
    """``n`` picks, each observed at its arm's ms/token (times a noise factor from ``rng``)."""
    ran = []
    for i in range(n):
        arm = plan.pick().arm
        cost = ms(arm, i) if callable(ms) else ms[arm]
        noise = rng.uniform(0.97, 1.03) if rng else 1.0
        plan.observe(arm, 100, cost * noise * 100 / 1000)
        ran.append(arm)
    return ran


def test_it_explores_each_plan_in_turn_then_runs_the_fastest():
    plan = OnlinePlan(ARMS, OnlineConfig())
    ran = run(plan, {FULL: 12.0, SKIP: 8.0, AR: 10.0}, 16)
    assert ran[:3] == ARMS  # each once, in order
    assert ran[3:].count(SKIP) >= 11  # the fastest, but for the re-checks
    assert plan.current == SKIP


def test_a_plan_that_measures_faster_takes_over():
    plan = OnlinePlan(ARMS, OnlineConfig(recheck_every=2))
    # the skip route is slow at first (its drafter has no history), then pays
    ran = run(plan, lambda arm, i: {FULL: 12.0, SKIP: 11.0 if i < 3 else 7.0, AR: 10.0}[arm], 40)
    assert plan.switches == [(plan.switches[0][0], AR.name, SKIP.name)]  # AR first, then the skip route
    assert ran[-10:].count(SKIP) >= 5  # every other pick a re-check


def test_noise_within_the_margin_does_not_flap():
    # two plans 2% apart under +-3% noise: whichever is current stays
    plan = OnlinePlan([FULL, SKIP, AR], OnlineConfig(margin=0.05, recheck_every=2))
    run(plan, {FULL: 10.2, SKIP: 10.0, AR: 20.0}, 200, random.Random(0))
    assert len(plan.switches) == 0


def test_without_a_margin_the_same_noise_flaps():
    # the test above can fail: the same timings with margin 0 switch back and forth
    plan = OnlinePlan([FULL, SKIP, AR], OnlineConfig(margin=0.0, recheck_every=2, window=2))
    run(plan, {FULL: 10.2, SKIP: 10.0, AR: 20.0}, 200, random.Random(0))
    assert len(plan.switches) >= 2


def test_a_plan_far_slower_is_not_rechecked():
    plan = OnlinePlan(ARMS, OnlineConfig(recheck_every=2))
    ran = run(plan, {FULL: 30.0, SKIP: 8.0, AR: 10.0}, 40)
    assert ran[3:].count(FULL) == 0  # over GIVE_UP times the current plan's
    assert ran[3:].count(AR) > 0


def test_a_remembered_estimate_counts_as_one_measurement():
    plan = OnlinePlan(ARMS, OnlineConfig(), prior={"pipespec 0-2": 8.0, "ar": 10.0, "pipespec 0-1-2": 12.0})
    ran = run(plan, {FULL: 12.0, SKIP: 8.0, AR: 10.0}, 8)
    assert ran == [SKIP] * 8  # no exploration; AR, 25% slower, is due for a re-check after 40
    assert plan.summary()["remembered"] == ["ar", "pipespec 0-1-2"]


def test_a_plan_not_remembered_is_explored_first_then_the_fastest_remembered_runs():
    plan = OnlinePlan(ARMS, OnlineConfig(), prior={"ar": 10.0, "pipespec 0-1-2": 12.0})
    ran = run(plan, {FULL: 12.0, SKIP: 8.0, AR: 10.0}, 3)
    assert ran == [SKIP, SKIP, SKIP]


def test_an_empty_run_measures_nothing():
    plan = OnlinePlan([FULL, AR], OnlineConfig())
    arm = plan.pick().arm
    plan.observe(arm, 0, 1.0)
    assert plan.estimate(arm) is None


@pytest.mark.parametrize(
    "routes, methods, want",
    [
        ((), ("pipespec",), ["pipespec 0-1-2", "pipespec 0-2", "pipespec 1-2", "ar"]),
        (("0-2",), ("pipespec", "sd"), ["pipespec 0-2", "sd 0-2", "ar"]),
    ],
)
def test_the_arms_are_each_method_on_each_route_then_ar(routes, methods, want):
    got = arms(OnlineConfig(routes=routes, methods=methods), 3, frozenset())
    assert [a.name for a in got] == want


def test_the_default_routes_keep_a_model_free_stage_first():
    got = arms(OnlineConfig(), 3, frozenset({0}))
    assert [a.route for a in got] == [(0, 1, 2), (0, 2), (2,)]
    got = arms(OnlineConfig(), 4, frozenset({0}))
    assert all(a.route[0] == 0 for a in got[:-1]) and len(got) == 5
    # named, a route may leave it out
    assert [a.name for a in arms(OnlineConfig(routes=("1-2",)), 3, frozenset({0}))] == ["pipespec 1-2", "ar"]


def test_a_challenger_is_rechecked_as_often_as_it_may_still_win():
    """Prompts differ by about 10%: a challenger 3% slower is re-checked often (it may win), one
    45% slower rarely, one over 2x slower never; with one noisy first measurement, a plan that is
    in fact faster gets its re-checks within a few prompts and takes over."""
    close, far = Arm("pipespec", (1, 2)), Arm("pipespec", (0, 1, 2))
    plan = OnlinePlan([SKIP, close, far, AR], OnlineConfig())
    rng = random.Random(1)

    def noisy(arm, i):
        return {SKIP: 10.0, close: 10.3, far: 14.5, AR: 25.0}[arm] * rng.uniform(0.88, 1.12)

    later = run(plan, noisy, 4 + 144)[4:]
    assert later.count(close) >= 5
    assert 1 <= later.count(far) <= 4
    assert later.count(AR) == 0  # beyond GIVE_UP
    # the faster plan's first prompt was a hard one (30% slow): it is back within 8 prompts, and wins
    plan = OnlinePlan([SKIP, AR], OnlineConfig())
    ran = run(plan, lambda arm, i: 10.0 * 1.3 if (arm, i) == (SKIP, 0) else {SKIP: 10.0, AR: 12.0}[arm], 16)
    assert SKIP in ran[2:10] and plan.current == SKIP


def test_a_longer_exploration_takes_the_plans_in_turn():
    plan = OnlinePlan(ARMS, OnlineConfig(explore=2))
    assert run(plan, {FULL: 12.0, SKIP: 8.0, AR: 10.0}, 6) == ARMS + ARMS
