"""The paper's analytical model: formulas, Theorem 1 and the limits (property tests)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipespec_mpi.analysis import analytical as an

alphas = st.floats(min_value=1e-6, max_value=1 - 1e-6, allow_nan=False)
gammas = st.floats(min_value=1e-3, max_value=64.0, allow_nan=False)
int_gammas = st.integers(min_value=1, max_value=64)
ratios = st.floats(min_value=0.05, max_value=1000.0, allow_nan=False)


@given(alphas, int_gammas)
def test_geometric_sum_is_the_sum_of_powers(alpha, gamma):
    direct = sum(alpha**k for k in range(gamma + 1))
    assert an.geometric_sum(alpha, gamma) == pytest.approx(direct, rel=1e-9)
    assert an.expected_accepted(alpha, gamma) == pytest.approx(direct - 1, rel=1e-9, abs=1e-12)


@settings(max_examples=300)
@given(alphas, gammas)
def test_theorem_1_pipespec_rate_exceeds_one(alpha, gamma):
    # for every 0 < alpha < 1 and gamma > 0 the PipeSpec verifier commits more than one token per step
    assert an.pipespec_tokens_per_step(alpha, gamma) > 1.0


@given(alphas, gammas)
def test_rate_bounded_by_always_verifying(alpha, gamma):
    n = an.pipespec_tokens_per_step(alpha, gamma)
    assert n <= an.geometric_sum(alpha, gamma) + 1e-12 <= gamma + 1 + 1e-9
    assert 0.0 < an.verify_probability(alpha, gamma) < 1.0


@given(st.floats(0.01, 0.98), st.floats(0.001, 0.01), int_gammas)
def test_rate_increases_with_alpha(alpha, d, gamma):
    assert an.pipespec_tokens_per_step(alpha + d, gamma) > an.pipespec_tokens_per_step(alpha, gamma)


@given(alphas, int_gammas)
def test_rate_increases_with_the_window(alpha, gamma):
    # non-decreasing; once alpha^(gamma+1) is below double precision the two are equal up to the
    # last bit (alpha=0.524, gamma=55: ...6792 vs ...6794)
    wider, narrower = an.pipespec_tokens_per_step(alpha, gamma + 1), an.pipespec_tokens_per_step(alpha, gamma)
    assert wider >= narrower or wider == pytest.approx(narrower, rel=1e-15)


@given(int_gammas, ratios)
def test_limit_alpha_to_zero(gamma, c):
    a = 1e-12
    assert an.geometric_sum(a, gamma) == pytest.approx(1.0)
    assert an.verify_probability(a, gamma) == pytest.approx(0.0, abs=1e-9)
    assert an.pipespec_tokens_per_step(a, gamma) == pytest.approx(1.0)
    # SD with nothing accepted pays for the drafts and gets one token: slower than AR
    assert an.sd_tokens_per_target_time(a, gamma, c) == pytest.approx(1 / (gamma / c + 1))
    assert an.sd_tokens_per_target_time(a, gamma, c) < 1.0
    assert an.pipespec_tokens_per_step(0.0, gamma) == 1.0


@given(int_gammas, ratios)
def test_limit_alpha_to_one(gamma, c):
    a = 1 - 1e-12
    assert an.geometric_sum(a, gamma) == pytest.approx(gamma + 1, rel=1e-6)
    assert an.verify_probability(a, gamma) == pytest.approx(1.0, rel=1e-6)
    assert an.pipespec_tokens_per_step(a, gamma) == pytest.approx(gamma + 1, rel=1e-6)
    assert an.sd_tokens_per_target_time(a, gamma, c) == pytest.approx((gamma + 1) / (gamma / c + 1), rel=1e-6)
    assert an.pipespec_tokens_per_step(1.0, gamma) == gamma + 1


@given(alphas, int_gammas)
def test_sd_with_free_drafts_is_the_geometric_sum(alpha, gamma):
    assert an.sd_tokens_per_target_time(alpha, gamma, 1e12) == pytest.approx(an.geometric_sum(alpha, gamma))


def test_accuracy_near_one():
    # the textbook (1 - a^(g+1)) / (1 - a) loses digits here; the expm1 form must not
    a = 1 - 1e-13
    assert an.geometric_sum(a, 10) == pytest.approx(11 - 55e-13, rel=1e-12)


def test_documented_discrepancies_of_rho():
    # a window of 0 still "verifies" with probability alpha (harmless: S = 1)
    assert an.verify_probability(0.7, 0) == pytest.approx(0.7)
    assert an.pipespec_tokens_per_step(0.7, 0) == pytest.approx(1.0)
    # unbounded window: rho -> alpha / (1 + alpha) <= 1/2 and E[N] -> 1 / (1 - alpha^2), while at
    # alpha = 1 rho = 1 for every window: the limits do not commute
    a = 0.99
    assert an.verify_probability(a, 1e6) == pytest.approx(a / (1 + a))
    assert an.pipespec_tokens_per_step(a, 1e6) == pytest.approx(1 / (1 - a * a))
    assert an.verify_probability(1.0, 1e6) == 1.0


@given(alphas, int_gammas)
def test_alpha_from_mean_committed_inverts_the_sum(alpha, gamma):
    m = an.geometric_sum(alpha, gamma)
    assert an.alpha_from_mean_committed(m, gamma) == pytest.approx(alpha, abs=1e-7)


def test_alpha_from_trace_is_the_maximum_likelihood():
    # 3 accepted then rejected; 2 of 2 accepted (no rejection); 0 accepted then rejected
    assert an.alpha_from_trace([[4, 3], [2, 2], [3, 0]]) == pytest.approx(5 / 7)
    assert an.alpha_from_trace([]) == 0.0


def test_optimal_sd_window_grows_with_draft_speed():
    g_slow, _ = an.optimal_sd_window(0.8, 2.0)
    g_fast, r_fast = an.optimal_sd_window(0.8, 50.0)
    assert g_fast > g_slow
    assert r_fast == pytest.approx(an.sd_tokens_per_target_time(0.8, g_fast, 50.0))


@pytest.mark.parametrize("bad", [-0.1, 1.1, math.nan])
def test_rejects_bad_alpha(bad):
    with pytest.raises(ValueError):
        an.geometric_sum(bad, 4)


def test_rejects_bad_gamma_and_ratio():
    with pytest.raises(ValueError):
        an.verify_probability(0.5, -1)
    with pytest.raises(ValueError):
        an.sd_tokens_per_target_time(0.5, 4, 0.0)
    with pytest.raises(ValueError):
        an.alpha_from_mean_committed(7.0, 4)
