"""The adaptive policy: its goodput arithmetic, its running estimates and the decisions they make."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest

from pipespec_mpi.config import DecodeConfig, validate_decode
from pipespec_mpi.config.schema import Policy
from pipespec_mpi.speculative.goodput import (
    MAX_POSITIONS,
    Estimates,
    RowCost,
    RowLine,
    allot_rows,
    choose,
    draft_reach,
    expected_committed,
    survivals,
    verify_length,
)
from pipespec_mpi.speculative.policy import Act, Decision, View, adaptive_rule, paper_rule

ADAPTIVE = DecodeConfig(policy="adaptive", lookahead=0, max_new_tokens=64, max_run_ahead=8, max_verify=8,
                        draft_survival=0.5)  # fmt: skip


@dataclass(frozen=True)
class Seen:
    """A stage's view with the adaptive policy's estimates and clock at the decision."""

    v: View
    est: Estimates
    now: float


def view(est: Estimates, now: float = 10.0, **kw) -> Seen:
    base = dict(method="pipespec", first=False, last=True, lookup=False, committed=5, capped=False)
    base.update(kw)
    return Seen(View(**base), est, now)


def decide(s: Seen, cfg: DecodeConfig) -> Decision:
    """The rule of ``cfg``'s policy: the adaptive one on ``s``'s estimates, else the paper's."""
    if Policy(cfg.policy).learns:
        return adaptive_rule(s.v, cfg, s.est, s.now)
    return paper_rule(s.v, cfg)


def timed(c0: float = 0.02, slope: float = 0.0, gap: float | None = None, accept: float = 0.9) -> Estimates:
    """Estimates that have seen forwards of c(k) = c0 (1 + slope k), an upstream delivering a
    token every ``gap`` seconds (last one just now) and an acceptance of ``accept`` everywhere."""
    est = Estimates(accept_prior=accept, rate=0.1)
    for k in range(0, 9):
        est.forward(k, c0 * (1 + slope * k))
    if gap is not None:
        est.arrived(10.0 - gap, 1)
        est.arrived(10.0, 1)
    return est


# ------------------------------------------------------------------------ the arithmetic
def test_expected_committed_counts_the_bonus_and_each_surviving_position():
    assert expected_committed([0.5] * 4, 0) == 1.0
    assert expected_committed([1.0] * 4, 3) == 4.0
    assert expected_committed([0.0] * 4, 3) == 1.0
    assert expected_committed([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)


def test_a_verification_is_cut_only_where_the_rows_do_not_pay():
    flat = [0.1] + [0.4] * 20  # a memory-bound GPU: one jump, then flat (the paper's 4-bit 70B)
    assert verify_length([0.5] * 20, flat, 12) == 12
    linear = [1.0 + 0.1 * k for k in range(21)]  # each row 10% of a step: stop where S_j < 0.1
    assert verify_length([0.5] * 20, linear, 12) == 3  # 0.5^3 = 0.125 pays, 0.5^4 does not
    assert verify_length([0.99] * 20, linear, 12) == 12
    assert verify_length([0.0] * 20, linear, 5) == 1  # never below one


def test_no_wait_without_a_known_or_able_upstream():
    cost = [0.02] * 9
    assert choose([0.9] * 8, cost, 0, 8, 8, None).act == "own"
    assert choose([0.9] * 8, cost, 2, 8, 8, None) == choose([0.9] * 8, cost, 2, 8, 0, 0.001)


def test_a_fast_upstream_is_waited_for_and_a_slow_one_is_not():
    cost = [0.025 * (1 + 0.03 * k) for k in range(9)]  # a CPU target, each row 3% of a step
    fast = choose([0.97] * 8, cost, 0, 8, 8, 0.005)
    assert fast.act == "wait" and fast.n > 1
    assert choose([0.97] * 8, cost, 0, 8, 8, 0.5).act == "own"
    # a poor drafter is not waited for even when it is fast
    assert choose([0.05] * 8, cost, 0, 8, 8, 0.005).act == "own"
    # the wait never aims beyond what one verification may take or the upstream can deliver
    assert choose([0.99] * 8, cost, 0, 8, 3, 0.0001).n <= 3


def test_draft_reach_stops_after_the_first_distance_below_the_threshold():
    assert draft_reach([1.0, 0.8, 0.6, 0.4, 0.2], 0.5, 8) == 4
    assert draft_reach([1.0] * 4, 0.5, 8) == 8
    assert draft_reach([0.1] * 4, 0.5, 8) == 1  # the boundary is always drafted: it stays measured
    assert draft_reach([0.1] * 4, 0.0, 8) == 8


# ------------------------------------------------------------------------ the estimates
def test_acceptance_is_learned_per_position_and_unseen_positions_read_as_the_last_seen():
    est = Estimates(accept_prior=0.6, rate=0.5)
    est.verified(3, 1)  # position 1 accepted, 2 rejected, 3 not judged
    a = est.acceptance()
    assert a[0] == pytest.approx(0.8)  # 0.6 + 0.5 (1 - 0.6)
    assert a[1] == pytest.approx(0.4)  # first seen: starts from position 1 (0.8), then rejected
    assert est.seen == 2 and a[2] == a[1] and a[MAX_POSITIONS - 1] == a[1]


def test_a_position_no_longer_tried_drifts_towards_the_pooled_acceptance():
    est = Estimates(accept_prior=0.6, rate=0.2)
    est.verified(4, 1)  # position 2 rejected once: low
    low = est.accept[1]
    for _ in range(200):
        est.verified(1, 1)  # only position 1 is tried from now on, always accepted
    assert est.accept[1] > low + 0.3 and est.pooled > 0.9


def test_costs_are_measured_and_interpolated_and_gaps_count_a_silence():
    est = Estimates(accept_prior=0.6, rate=0.1)
    assert est.costs(3) == [1.0] * 4  # nothing timed: all alike (the paper's rule)
    est.forward(0, 0.02)
    est.forward(4, 0.04)
    assert est.costs(6) == pytest.approx([0.02, 0.025, 0.03, 0.035, 0.04, 0.04, 0.04])
    assert est.gap() is None and est.wait_gap(5.0) is None
    est.arrived(0.9, 1)
    est.forward(0, 0.05, end=1.0)
    est.arrived(1.0, 2)  # 2 tokens in 0.1 s, while this stage computed: g
    assert est.gap() == pytest.approx(0.05)
    assert est.wait_gap(1.0) == pytest.approx(0.025)  # optimistic until a wait was measured
    est.arrived(1.02, 2)  # 2 tokens in 0.02 s while it waited: g_w (shared cores: faster)
    assert est.gap() == pytest.approx(0.05) and est.wait_gap(1.02) == pytest.approx(0.01)
    assert est.wait_gap(2.02) == pytest.approx(1.0)  # silent for 1 s: waiting no longer looks cheap
    est.forward(1, 0.5, end=3.0)
    assert est.wait_gap(3.001) == pytest.approx(0.01)  # the silence counts from the forward's end
    est.restarted(4.0)
    assert est.wait_gap(4.001) == pytest.approx(0.01)
    est.arrived(4.5, 1)  # a slow one while waiting (noise): g_w is never above g
    est.arrived(5.5, 1)
    assert est.wait_gap(5.5) == pytest.approx(est.gap())


def test_survival_by_distance():
    est = Estimates(accept_prior=0.6, rate=0.5)
    est.fate(1, True)
    est.fate(3, False)
    est.fate(0, False)  # adopted tokens (distance 0) and far ones are not counted
    est.fate(MAX_POSITIONS + 5, False)
    assert est.survival[0] == 1.0 and est.survival[2] == 0.5 and est.survival[1] == 1.0


# ------------------------------------------------------------------------ the decisions
def test_an_adaptive_verifier_waits_for_a_good_fast_drafter_and_reads_its_idle_flag():
    est = timed(c0=0.025, slope=0.03, gap=0.004, accept=0.97)
    d = decide(view(est, pending=1), ADAPTIVE)
    assert d.act is Act.WAIT and d.upstream_matters and not d.idle
    idle = decide(view(est, pending=1, upstream_idle=True), ADAPTIVE)
    assert idle.act is Act.VERIFY and idle.n == 1
    assert decide(view(est, pending=0, upstream_idle=True), ADAPTIVE).act is Act.OWN


def test_an_adaptive_verifier_steps_on_its_own_when_its_drafter_is_slow_or_poor():
    assert decide(view(timed(gap=1.0), pending=0), ADAPTIVE).act is Act.OWN
    assert decide(view(timed(gap=0.001, accept=0.02), pending=0), ADAPTIVE).act is Act.OWN


def test_an_adaptive_verifier_waits_for_a_model_free_drafters_answer_for_an_own_step_at_most():
    """A slow, poor upstream by its delivery rate: the verifier would step on its own. From a
    model-free drafter that has not answered its tokens yet it waits for the answer (a proposal or
    an idle flag), but not longer than an own step costs, nor while its other slots' forward runs."""
    est = timed(c0=0.02, gap=1.0, accept=0.3)
    est.free_since = 9.999  # its last forward ended a millisecond ago
    assert decide(view(est, pending=0), ADAPTIVE).act is Act.OWN  # a model upstream: by the rates
    d = decide(view(est, pending=0, upstream_free=True), ADAPTIVE)
    assert d.act is Act.WAIT and d.upstream_matters
    # the wait ends by the clock alone: the stage decides again then (a rank asleep on its bell)
    assert d.until == pytest.approx(9.999 + 0.02)
    assert decide(view(est, pending=0, upstream_free=True, upstream_idle=True), ADAPTIVE).act is Act.OWN
    assert decide(view(est, pending=0, upstream_free=True, joining=True), ADAPTIVE).act is Act.OWN
    late = view(est, pending=0, upstream_free=True, now=10.03)  # 31 ms since its forward: > c(0)
    assert decide(late, ADAPTIVE).act is Act.OWN
    fresh = Estimates(accept_prior=0.3, rate=0.1)  # no own step timed yet: it waits (for a ring)
    d = decide(view(fresh, pending=0, upstream_free=True), ADAPTIVE)
    assert d.act is Act.WAIT and d.until is None
    # something pending: the rates decide (the drafter has answered)
    assert decide(view(est, pending=1, upstream_free=True), ADAPTIVE).act is Act.VERIFY


def test_an_adaptive_drafter_is_held_by_survival_and_says_it_is_idle():
    est = timed()
    for _ in range(50):
        est.fate(3, False)
    drafter = dict(first=True, last=False, down_committed=4)
    assert decide(view(est, committed=6, **drafter), ADAPTIVE).act is Act.DRAFT  # distance 3: drafted
    held = decide(view(est, committed=7, **drafter), ADAPTIVE)
    assert held.act is Act.WAIT and held.idle
    off = DecodeConfig(policy="adaptive", lookahead=0, max_new_tokens=64, max_run_ahead=8, max_verify=8,
                       draft_survival=0.0)  # fmt: skip
    assert decide(view(est, committed=7, **drafter), off).act is Act.DRAFT
    # the static policy never looks at estimates
    static = DecodeConfig(lookahead=0, max_new_tokens=64, max_run_ahead=8, max_verify=8, policy="static")
    assert decide(view(est, committed=7, **drafter), static).act is Act.DRAFT


def test_a_slot_joining_a_batched_forward_does_not_wait():
    est = timed(c0=0.025, slope=0.03, gap=0.004, accept=0.97)  # waiting pays (the test above)
    assert decide(view(est, pending=1), ADAPTIVE).act is Act.WAIT
    joined = decide(view(est, pending=1, joining=True), ADAPTIVE)
    assert joined.act is Act.VERIFY and joined.n == 1 and joined.joined
    assert decide(view(est, pending=0, joining=True), ADAPTIVE).act is Act.OWN
    # an action taken anyway is not a wait given up
    slow = timed(gap=1.0)
    assert not decide(view(slow, pending=0, joining=True), ADAPTIVE).joined


def test_sd_and_ar_ignore_the_adaptive_policy():
    est = timed(gap=0.001, accept=0.99)
    sd = DecodeConfig(policy="adaptive", sd_window=3, max_new_tokens=64, max_run_ahead=8, max_verify=8)
    d = decide(view(est, method="sd", pending=1), sd)
    assert d.act is Act.WAIT and d.want == 8  # SD's fixed window: committed 5 + 3
    assert decide(view(est, method="ar"), sd).act is Act.OWN


def test_adaptive_decisions_are_always_legal():
    """Whatever the estimates, a decision is one the static rules could also reach: verify at
    most what is pending and what one forward may take, wait only on an upstream that can still
    deliver, and never commit past the run-ahead bound."""
    rng = random.Random(5)
    for _ in range(3000):
        est = Estimates(accept_prior=rng.random(), rate=rng.choice((0.05, 0.5, 1.0)))
        for _ in range(rng.randint(0, 6)):
            est.forward(rng.randint(0, 10), rng.random() * rng.choice((0.001, 0.1, 1.0)))
            n = rng.randint(1, 10)
            est.verified(n, rng.randint(0, n))
            est.arrived(rng.random() * 10, rng.randint(0, 5))
            est.fate(rng.randint(1, 10), rng.random() < 0.5)
        cfg = DecodeConfig(policy="adaptive", lookahead=0, sd_window=None, max_new_tokens=rng.randint(1, 30),
                           max_run_ahead=rng.randint(1, 10), max_verify=rng.randint(1, 10),
                           draft_survival=rng.choice((0.0, 0.5, 0.9)))  # fmt: skip
        assert not validate_decode(cfg, sd_needed=False)
        first = rng.random() < 0.3
        last = not first and rng.random() < 0.5
        s = view(est, first=first, last=last, committed=rng.randint(0, cfg.max_new_tokens),
                 down_committed=0 if last else rng.randint(0, 12), pending=0 if first else rng.randint(0, 12),
                 upstream_idle=rng.random() < 0.3, now=rng.random() * 12)  # fmt: skip
        s = replace(s, v=replace(s.v, capped=s.v.committed >= cfg.max_new_tokens))
        d, v = decide(s, cfg), s.v
        if d.act is Act.VERIFY:
            assert 1 <= d.n <= min(v.pending, cfg.max_verify)
        if d.act is Act.WAIT and not d.idle and not v.first and not v.capped:
            assert not v.upstream_idle or not d.upstream_matters
        if not v.last and d.act in (Act.DRAFT, Act.VERIFY, Act.OWN):
            assert v.committed - v.down_committed < cfg.max_run_ahead


def test_the_policy_keys_are_validated():
    bad = DecodeConfig(policy="greedy-ish", draft_survival=1.5, accept_prior=-0.1, estimate_rate=0.0)
    problems = " ".join(validate_decode(bad, sd_needed=False))
    for key in ("decode.policy='greedy-ish'", "decode.draft_survival=1.5", "decode.accept_prior=-0.1",
                "decode.estimate_rate=0.0"):  # fmt: skip
        assert key in problems


def test_a_batched_forward_shares_its_rows_by_survival():
    good, poor = survivals([0.9] * 8, 6), survivals([0.3] * 8, 6)
    assert good[0] == pytest.approx(0.9) and good[1] == pytest.approx(0.81)
    # 2 forwards, 8 rows: 2 base rows, 6 extra: the likely positions first, whichever slot
    assert allot_rows([good, poor], 8) == [6, 0]  # 0.9^6 = 0.53 > 0.3: the poor slot steps alone
    assert allot_rows([good, poor], 9) == [6, 1]
    assert allot_rows([good, poor], 100) == [6, 6]  # room for everything asked
    assert allot_rows([good, poor, []], 3) == [0, 0, 0]  # no extra row: every slot steps alone
    assert allot_rows([[], good], 4) == [0, 2]  # a slot with no proposal takes only its row
    assert sum(allot_rows([good, poor, good], 9)) == 6


def test_rows_that_do_not_pay_are_not_given_out():
    good, poor = survivals([0.9] * 8, 6), survivals([0.3] * 8, 6)
    # two slots, 12 ms + 3 ms a slot + 3 ms a row: 18 ms for 2 tokens; good's sixth row (0.53)
    # still beats the forward's rate (6.2 tokens in 36 ms: 0.52 a row), poor's first (0.3) not
    assert allot_rows([good, poor], 100, RowLine(0.012, 0.003, 0.003)) == [6, 0]
    assert allot_rows([good, poor], 100, RowLine(0.012, 0.003, 0.006)) == [2, 0]  # 0.73 < 0.74
    assert allot_rows([good, poor], 100, RowLine(0.0, 0.0, 0.001)) == [0, 0]  # only rows cost
    assert allot_rows([good, poor], 5, RowLine(0.012, 0.003, 0.003)) == [3, 0]  # within the budget
    assert allot_rows([good, poor], 100) == [6, 6]  # costs unknown: every pair pays
    assert allot_rows([good, poor], 100, RowLine(0.04, 0.0, 0.0)) == [6, 6]  # free rows (a GPU)


def _rate(surv, taken, line):
    tokens = len(surv) + sum(sum(s[:k]) for s, k in zip(surv, taken, strict=True))
    return tokens / (line.fixed + line.per_slot * len(surv) + line.per_row * sum(taken))


def test_the_rows_given_out_maximise_the_forwards_expected_tokens_per_second():
    """Against every allotment of the same budget (each slot a prefix of its proposal): none has a
    higher expected rate, (B + the survivals verified) / C(B, rows)."""
    import itertools

    rng = random.Random(3)
    for _ in range(300):
        surv = [
            survivals([rng.random() for _ in range(8)], rng.randint(0, 4)) for _ in range(rng.randint(1, 3))
        ]
        line = RowLine(rng.choice((0.0, 0.01, 0.03)), rng.uniform(0.0, 0.01), rng.uniform(1e-4, 0.01))
        if line.fixed + line.per_slot == 0.0:
            continue
        budget = len(surv) + rng.randint(0, 8)
        got = allot_rows(surv, budget, line)
        best = max(
            _rate(surv, t, line)
            for t in itertools.product(*(range(len(s) + 1) for s in surv))
            if sum(t) <= budget - len(surv)
        )
        assert _rate(surv, got, line) == pytest.approx(best), (surv, line, budget, got)


def test_row_cost_fits_a_batched_forwards_slots_and_verification_rows():
    rc = RowCost(rate=0.05)
    assert rc.line() is None
    for _ in range(30):  # every forward four slots verifying four rows each: no slope to see
        rc.observe(4, 20, 0.022)
    assert rc.line() is None
    rng = random.Random(0)
    for _ in range(200):  # 12 ms + 3 ms a row, a slot's own or a verification's, with noise
        b = rng.randint(1, 4)
        n = b + rng.randint(0, 10)
        rc.observe(b, n, 0.012 + 0.003 * n + rng.uniform(-5e-4, 5e-4))
    fixed, per_slot, per_row = rc.line()
    assert fixed == pytest.approx(0.012, abs=1.5e-3)
    assert per_slot == pytest.approx(0.003, abs=5e-4) and per_row == pytest.approx(0.003, abs=2e-4)
    # the line follows a node that got slower per row
    for _ in range(200):
        b = rng.randint(1, 4)
        n = b + rng.randint(0, 10)
        rc.observe(b, n, 0.012 + 0.006 * n)
    assert rc.line().per_row == pytest.approx(0.006, abs=3e-4)


def test_a_slot_that_costs_more_than_a_row_leaves_the_row_cost_unknown_until_rows_vary():
    """Regression (a 4-slot sampling job on tiny models verified nothing at all): steps alone
    (one row per slot) show what a slot costs, not what a verification row costs; priced as a slot,
    no row paid, so no verification ever ran to measure one. Now the per-row cost stays unknown
    (every row pays) until verification rows varied apart from the slots, and fades back to
    unknown after a long run of forwards without them."""
    rc = RowCost(rate=0.05)
    for i in range(200):  # 1 ms + 2 ms a slot, no verification: the slots vary, the rows with them
        b = 1 + i % 4
        rc.observe(b, b, 0.001 + 0.002 * b)
    assert rc.line() is None
    for i in range(40):  # verifications: a row costs 0.1 ms
        b, e = 1 + i % 4, (3 * i) % 11
        rc.observe(b, b + e, 0.001 + 0.002 * b + 0.0001 * e)
    line = rc.line()
    assert line.per_slot == pytest.approx(0.002, abs=1e-6) and line.per_row == pytest.approx(1e-4)
    # one slot: 2.5 tokens in 3.3 ms after three rows, so a 0.1 ms row must survive 0.076 to pay
    assert allot_rows([[0.9, 0.5, 0.1, 0.05]], 16, line) == [3]
    for i in range(400):  # cut everywhere (or no proposals) for a long time: measured anew
        b = 1 + i % 4
        rc.observe(b, b, 0.001 + 0.002 * b)
    assert rc.line() is None
