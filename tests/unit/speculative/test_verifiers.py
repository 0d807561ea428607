"""The verifiers (speculative/verifiers.py): the rule each sampler gets, greedy, Leviathan and
accept-all verification (split from the stage loop's pieces, stage/test_loop.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipespec_mpi.config import SamplingConfig
from pipespec_mpi.speculative.sampling import Sampler
from pipespec_mpi.speculative.verifiers import AcceptAll, Greedy, Gumbel, Leviathan, make_verifier


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
