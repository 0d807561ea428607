"""The paper's analytical model of PipeSpec, as pure functions (no MPI, no torch).

Notation (McDanel et al., arXiv 2505.01572, Section "Analytical model"):

  alpha    acceptance rate between two adjacent stages: the probability that the verifier's greedy
           token equals the drafter's at a position, independently of the other positions (i.i.d.)
  gamma    the window: how many draft tokens a verification checks
  c        speed ratio draft / target: how many draft forwards fit into one target forward
  rho      probability that, in a step, the verifier verifies (rather than generating one token
           of its own)

Formulas (as given by the paper):

  tokens committed by one verification of gamma drafts (accepted prefix + correction or bonus):
      S(alpha, gamma) = 1 + alpha + ... + alpha^gamma = (1 - alpha^(gamma+1)) / (1 - alpha)
  expected tokens per step of a PipeSpec verifier:
      E[N] = (1 - rho) * 1 + rho * S(alpha, gamma)
  steady-state verification probability:
      rho  = alpha / (1 - alpha^(gamma+1) + alpha)
  synchronous speculative decoding, tokens per unit of target time:
      R_SD = S(alpha, gamma) / (gamma / c + 1)

Theorem 1: for 0 < alpha < 1 and gamma > 0, E[N] > 1 (PipeSpec is never slower than AR in
target steps). It is immediate: E[N] = 1 + rho * (alpha + ... + alpha^gamma) with rho > 0.

Limits (checked by tests/unit/analysis/test_analytical.py):

  alpha -> 0   S -> 1, rho -> 0, E[N] -> 1; R_SD -> 1 / (gamma/c + 1) < 1 (SD loses to AR)
  alpha -> 1   S -> gamma + 1, rho -> 1, E[N] -> gamma + 1; R_SD -> (gamma+1) / (gamma/c + 1)
  c -> inf     R_SD -> S (drafting is free)

Discrepancies found when checking the paper's rho (documented, not "fixed"):

  * rho(alpha, gamma=0) = alpha, not 0: with a window of 0 there is nothing to verify, yet the
    formula gives a verification probability alpha (harmless: S(alpha, 0) = 1, so E[N] = 1).
  * for fixed alpha < 1 and gamma -> infinity, rho -> alpha / (1 + alpha) <= 1/2, whereas
    rho(alpha=1, gamma) = 1 for every gamma: the two limits do not commute, and the closed form says
    that even a near-perfect drafter with an unbounded window verifies at most half of the steps.
    E[N] -> 1 / (1 - alpha^2) in that limit, about half of the S -> 1 / (1 - alpha) that a verifier
    that always had drafts pending would get. The real pipeline's rho depends on the draft speed c
    (how many drafts are pending after a rollback), which the closed form does not contain; the
    simulator (pipespec_mpi/simulate/) measures it instead.
  * E[N] counts tokens per verifier *step* and ignores that verifying gamma tokens costs more than a
    one-token step; with a target whose multi-token forward costs several one-token forwards (the
    paper's 4-bit 70B: ~124 ms for one token, ~430 ms for a multi-token forward) the time speedup
    is far below E[N]. The simulator uses measured forward times instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise ValueError(f"alpha={alpha}: must be in [0, 1]")


def _check_gamma(gamma: float) -> None:
    if not gamma >= 0 or math.isinf(gamma):
        raise ValueError(f"gamma={gamma}: must be finite and >= 0")


def geometric_sum(alpha: float, gamma: float) -> float:
    """S = (1 - alpha^(gamma+1)) / (1 - alpha): tokens committed by one verification of a
    ``gamma``-token window with i.i.d. acceptance ``alpha`` (accepted prefix + one token).

    Evaluated as expm1((gamma+1) ln a) / expm1(ln a), which stays accurate as alpha -> 1
    (the textbook form cancels catastrophically there); gamma may be fractional.
    """
    _check_alpha(alpha)
    _check_gamma(gamma)
    if alpha == 0.0:
        return 1.0
    if alpha == 1.0:
        return gamma + 1.0
    la = math.log(alpha)
    return math.expm1((gamma + 1.0) * la) / math.expm1(la)


def expected_accepted(alpha: float, gamma: float) -> float:
    """Mean accepted draft tokens per verification: S - 1 = alpha + ... + alpha^gamma."""
    return geometric_sum(alpha, gamma) - 1.0


def verify_probability(alpha: float, gamma: float) -> float:
    """The paper's steady-state rho = alpha / (1 - alpha^(gamma+1) + alpha)."""
    _check_alpha(alpha)
    _check_gamma(gamma)
    if alpha == 0.0:
        return 0.0
    # 1 - alpha^(gamma+1) = -expm1((gamma+1) ln alpha), accurate near alpha = 1
    tail = -math.expm1((gamma + 1.0) * math.log(alpha))
    return alpha / (tail + alpha)


def pipespec_tokens_per_step(alpha: float, gamma: float) -> float:
    """E[N] = (1 - rho) + rho * S: expected tokens a PipeSpec verifier commits per step."""
    rho = verify_probability(alpha, gamma)
    return (1.0 - rho) + rho * geometric_sum(alpha, gamma)


def sd_tokens_per_target_time(alpha: float, gamma: float, c: float) -> float:
    """R_SD = S / (gamma / c + 1): synchronous SD's tokens per target-forward time unit (its
    speedup over AR when a verification costs one target forward and a draft 1/c of one)."""
    if not c > 0:
        raise ValueError(f"c={c}: the draft/target speed ratio must be > 0")
    return geometric_sum(alpha, gamma) / (gamma / c + 1.0)


def bisect_increasing(
    f: Callable[[float], float],
    target: float,
    lo: float,
    hi: float,
    *,
    steps: int | None = None,
    tol: float = 0.0,
) -> float:
    """Where an increasing ``f`` reaches ``target`` between ``lo`` and ``hi``, by bisection: a
    midpoint where ``f < target`` becomes the low end, else the high end; ``steps`` halvings, or
    without ``steps`` as many as leave the interval at most ``tol`` wide. The last midpoint."""
    n = 0
    while (n < steps) if steps is not None else (hi - lo > tol):
        mid = 0.5 * (lo + hi)
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
        n += 1
    return 0.5 * (lo + hi)


def alpha_from_mean_committed(mean_committed: float, gamma: float, tol: float = 1e-12) -> float:
    """Invert S: the i.i.d. acceptance rate for which a ``gamma``-token verification commits
    ``mean_committed`` tokens on average (bisection; S is increasing in alpha)."""
    _check_gamma(gamma)
    if not 1.0 <= mean_committed <= gamma + 1.0:
        raise ValueError(f"mean_committed={mean_committed}: must be in [1, gamma + 1 = {gamma + 1}]")
    return bisect_increasing(lambda a: geometric_sum(a, gamma), mean_committed, 0.0, 1.0, tol=tol)


def alpha_from_trace(trace: list[list[int]] | list[tuple[int, int]]) -> float:
    """Maximum-likelihood i.i.d. acceptance from a verifier's [n_proposed, n_accepted] trace.

    Each verification is a run of Bernoulli(alpha) trials stopped at the first failure or after
    n_proposed trials: accepted tokens are successes, a rejection (n_accepted < n_proposed) one
    failure, so alpha = accepted / (accepted + rejections).
    """
    acc = sum(int(a) for _, a in trace)
    rej = sum(1 for n, a in trace if int(a) < int(n))
    return acc / (acc + rej) if acc + rej else 0.0


def optimal_sd_window(alpha: float, c: float, max_gamma: int = 64) -> tuple[int, float]:
    """The integer window maximising R_SD, and that rate."""
    best = max(range(1, max_gamma + 1), key=lambda g: sd_tokens_per_target_time(alpha, g, c))
    return best, sd_tokens_per_target_time(alpha, best, c)
