"""The verifiers (speculative/verifiers.py): the rule each sampler gets, greedy, Leviathan and
accept-all verification (split from the stage loop's pieces, stage/test_loop.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipespec_mpi.config import SamplingConfig
from pipespec_mpi.speculative.sampling import Sampler, gumbel, speculative_verify
from pipespec_mpi.speculative.verifiers import (
    AcceptAll,
    Greedy,
    Gumbel,
    Leviathan,
    Question,
    check_all,
    make_verifier,
)


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


# ------------------------------------------------------------------------------ on the device
def _questions(verifier_of, n_slots: int = 8):
    """A batched forward's questions: draws (n = 0) and verifications of 1..7 tokens, each slot
    its own rule (its own sampler key)."""
    torch.manual_seed(3)
    out = []
    for b in range(n_slots):
        n = b % 4 * 2 - 1 if b % 4 else 0
        out.append(
            Question(
                verifier_of(b), [int(x) for x in torch.randint(0, 9, (n,))], torch.randn(n + 1, 9), 5 + b
            )
        )
    return out


@pytest.mark.parametrize("rule", ["greedy", "gumbel"])
def test_check_all_answers_a_batched_forward_with_one_host_read(rule):
    """Every slot's verdict (draws and verifications of any length) from one batched accept and
    one host read, each equal to the slot's own verification alone."""
    from host_reads import HostReads

    def verifier_of(b: int):
        return Greedy() if rule == "greedy" else Gumbel(Sampler(SamplingConfig(temperature=1.0), key=b))

    qs = _questions(verifier_of)
    with HostReads() as reads:
        got = check_all(qs)
    assert reads.count == 1
    with HostReads() as reads:
        alone = [check_all([q])[0] for q in qs]
    assert reads.count == len(qs)  # the counter sees every read: one per question asked alone
    assert got == alone
    for q, c in zip(qs, got, strict=True):
        own = q.verifier.choices(q.logits, q.position).tolist()
        m = c.verdict.n_accepted
        assert q.proposal[:m] == own[:m] and c.verdict.next_token == own[m]
        assert m == len(q.proposal) or q.proposal[m] != own[m]


def test_gumbel_noise_is_a_function_of_key_position_and_token_on_any_device():
    """Position p's row is the same whichever verification it falls in, keys differ, and it is
    made on the logits' device (meta: no host tensor is mixed in)."""
    g = gumbel(7, 3, (4, 1000))
    assert torch.equal(g[1:], gumbel(7, 4, (3, 1000))) and not torch.equal(g, gumbel(8, 3, (4, 1000)))
    assert abs(g.mean().item() - 0.5772) < 0.1 and abs(g.std().item() - 1.2825) < 0.1
    meta = torch.empty(3, 50, device="meta")
    assert Sampler(SamplingConfig(temperature=0.8, top_k=5), key=1).tokens(meta, 4).device.type == "meta"
    assert Gumbel(Sampler(SamplingConfig(temperature=1.0), key=1)).choices(meta, 0).device.type == "meta"


def test_leviathan_decides_on_the_logits_device():
    """The acceptance and the residual or bonus draw are tensor ops on p's and q's device (meta)."""
    p = torch.empty(4, 50, device="meta", dtype=torch.float64)
    q = torch.empty(3, 50, device="meta")
    out = speculative_verify(torch.zeros(3, dtype=torch.long, device="meta"), q, p, torch.Generator())
    assert out.device.type == "meta" and out.shape == (2,)
