"""The decision of what a stage does next: a pure function, small named cases."""

from __future__ import annotations

from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.speculative.policy import Act, View, room
from pipespec_mpi.speculative.policy import paper_rule as decide

CFG = DecodeConfig(lookahead=0, max_new_tokens=20, max_run_ahead=4, max_verify=6)


def view(**kw) -> View:
    base = dict(method="pipespec", first=False, last=True, lookup=False, committed=5, capped=False)
    base.update(kw)
    return View(**base)


def test_a_drafter_drafts_up_to_its_run_ahead_bound():
    v = view(first=True, last=False, committed=7, down_committed=4)
    assert decide(v, CFG).act is Act.DRAFT
    at_bound = decide(view(first=True, last=False, committed=8, down_committed=4), CFG)
    assert at_bound.act is Act.WAIT and not at_bound.idle  # held by the bound: not starved


def test_a_lookup_drafter_may_propose_its_whole_room():
    d = decide(view(first=True, last=False, lookup=True, committed=5, down_committed=4), CFG)
    assert d.act is Act.LOOKUP and d.n == 3


def test_pipespec_verifies_whatever_is_pending_up_to_max_verify():
    assert decide(view(pending=3), CFG).n == 3
    assert decide(view(pending=9), CFG).n == 6


def test_pipespec_lookahead_zero_steps_on_its_own_when_nothing_is_pending():
    assert decide(view(pending=0), CFG).act is Act.OWN


def test_lookahead_zero_waits_for_a_working_model_free_drafter():
    on = DecodeConfig(lookahead=0, max_new_tokens=20, max_run_ahead=4, max_verify=6, wait_for_drafter=True)
    d = decide(view(pending=0, upstream_free=True), on)
    assert d.act is Act.WAIT and d.upstream_matters  # the caller reads the drafter's idle flag
    # the drafter has nothing (a miss, or capped): step on its own at once
    assert decide(view(pending=0, upstream_free=True, upstream_idle=True), on).act is Act.OWN
    # pending proposals are verified as before; off (the default), the paper's rule
    assert decide(view(pending=2, upstream_free=True), on).n == 2
    assert decide(view(pending=0, upstream_free=True), CFG).act is Act.OWN
    # a model upstream is never waited for with lookahead 0
    assert decide(view(pending=0, upstream_free=False), on).act is Act.OWN
    # SD is unchanged: it waits for its window whatever the drafter is
    sd = DecodeConfig(lookahead=0, sd_window=3, max_new_tokens=20, max_run_ahead=4, max_verify=6)
    assert decide(view(method="sd", pending=1, upstream_free=True), sd).act is Act.WAIT


def test_a_lookahead_waits_unless_the_upstream_is_idle():
    cfg = DecodeConfig(lookahead=3, max_new_tokens=20, max_run_ahead=4, max_verify=6)
    d = decide(view(pending=2), cfg)
    assert d.act is Act.WAIT and d.upstream_matters
    assert decide(view(pending=2, upstream_idle=True), cfg).n == 2
    assert decide(view(pending=0, upstream_idle=True), cfg).act is Act.OWN
    assert decide(view(pending=3), cfg).n == 3


def test_the_last_stage_keeps_room_for_the_bonus_token():
    # 2 tokens left: verify at most 1 proposal, whose bonus fills the budget
    assert decide(view(committed=18, pending=5), CFG).n == 1
    assert decide(view(committed=19, pending=5), CFG).act is Act.OWN


def test_sd_demands_a_window_and_verifies_only_a_full_one():
    cfg = DecodeConfig(lookahead=0, sd_window=3, max_new_tokens=20, max_run_ahead=4, max_verify=6)
    d = decide(view(method="sd", pending=2), cfg)
    assert d.act is Act.WAIT and d.want == 8
    d = decide(view(method="sd", pending=4), cfg)
    assert d.act is Act.VERIFY and d.n == 3 and d.want == 8


def test_an_sd_drafter_drafts_only_what_is_wanted():
    v = view(method="sd", first=True, last=False, committed=6, down_want=8)
    assert room(v, CFG) == 2 and decide(v, CFG).act is Act.DRAFT
    assert decide(view(method="sd", first=True, last=False, committed=8, down_want=8), CFG).act is Act.WAIT


def test_a_capped_stage_waits_and_says_it_is_idle_and_keeps_its_demand():
    d = decide(view(method="sd", capped=True, want=9), CFG)
    assert d.act is Act.WAIT and d.idle and d.want == 9


def test_idle_is_not_sticky():
    # a drafter that was capped, then rolled back, drafts again and is not idle any more
    d = decide(view(first=True, last=False, committed=3, down_committed=3), CFG)
    assert d.act is Act.DRAFT and not d.idle


def test_ar_steps_alone():
    assert decide(view(method="ar", pending=5), CFG).act is Act.OWN


# ---------------------------------------------------------------- the port: one factory, two policies
def test_one_factory_makes_each_policy_and_a_phase_keeps_what_was_learned():
    from pipespec_mpi.speculative.goodput import Estimates
    from pipespec_mpi.speculative.policy import (
        AdaptivePolicy,
        Arrived,
        ChoiceCounts,
        Forwarded,
        Judged,
        Restarted,
        StaticPolicy,
        make_policy,
    )

    reads = []

    def now() -> float:
        reads.append(1)
        return 10.0

    static = make_policy(DecodeConfig(policy="static"), now)
    assert type(static) is StaticPolicy and not static.shares_rows and static.report() == (ChoiceCounts(), {})
    static.observe(Arrived(3))
    static.observe(Restarted())
    assert reads == []  # the static rule reads no clock and learns nothing
    adaptive = make_policy(DecodeConfig(policy="adaptive"), now)
    assert type(adaptive) is AdaptivePolicy and adaptive.shares_rows
    adaptive.observe(Judged(4, 3))
    adaptive.observe(Forwarded(4, 0.02, 1.0))
    phase = adaptive.for_phase(DecodeConfig(policy="adaptive", max_verify=3))
    assert phase.cfg.max_verify == 3 and adaptive.cfg.max_verify == 16  # the old one unchanged
    assert phase.est is adaptive.est and phase.report()[1] == adaptive.report()[1]  # learned: kept
    mine = Estimates(0.2, 0.1)
    assert make_policy(DecodeConfig(policy="adaptive"), now, mine).est is mine  # the explorer's own
    assert type(make_policy(DecodeConfig(policy="static"), now, mine)) is StaticPolicy  # by the setting alone


def test_the_static_policy_asks_the_upstream_only_when_the_decision_depends_on_it():
    from pipespec_mpi.speculative.policy import StaticPolicy

    asked = []

    def idle() -> bool:
        asked.append(1)
        return True

    static = StaticPolicy(DecodeConfig(lookahead=2, max_new_tokens=20, max_verify=6, policy="static"))
    assert static.decide(view(pending=3), idle).act is Act.VERIFY and asked == []  # enough pending
    d = static.decide(view(pending=1), idle)  # one short of the lookahead: an idle upstream gives no more
    assert asked == [1] and d.act is Act.VERIFY and d.n == 1
    assert not d.chosen and static.decide_again_at(d, 0.0) is None


def test_the_adaptive_policy_counts_its_own_choices_and_reports_them_once(monkeypatch):
    from pipespec_mpi.speculative import policy as module
    from pipespec_mpi.speculative.policy import AdaptivePolicy, ChoiceCounts, Cut, Decision

    wait = Decision(Act.WAIT, upstream_matters=True)
    ruled = iter([Decision(Act.VERIFY, n=2), wait, wait, Decision(Act.WAIT, idle=True)])
    monkeypatch.setattr(module, "adaptive_rule", lambda v, cfg, est, now: next(ruled))
    policy = AdaptivePolicy(DecodeConfig(policy="adaptive"), lambda: 0.0)
    never = lambda: False  # noqa: E731
    assert not policy.decide(view(pending=4), never).chosen  # a verification cut to 2 of 4
    assert policy.decide(view(pending=0), never).chosen  # a wait it chose although it could act
    policy.decide(view(pending=0, waiting=True), never)  # the same wait, again: counted once
    policy.decide(view(first=True, last=False, committed=6, down_committed=4), never)  # a drafter held
    policy.observe(Cut())  # a batched stage cut its verification (stage/batch.py)
    counts, state = policy.report()
    assert counts == ChoiceCounts(waits_chosen=1, verify_cut=2, drafts_held=1) and "accept" in str(state)
    assert policy.report()[0] == ChoiceCounts()  # taken: the next prompt counts from zero
