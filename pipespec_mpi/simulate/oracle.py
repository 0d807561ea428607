"""Oracle models: stages whose tokens are functions of the prefix, with set agreement rates.

A ``TokenOracle`` defines the target's greedy continuation of any prefix (a hash of the prefix)
and, going down the hierarchy, makes stage j agree with stage j+1 at a prefix with probability
rates[j] (i.i.d. per prefix), or, on the target's own output path, as a recorded run's
verifications say (``traces``). ``OracleScorer`` and ``OracleLookup`` are the stage models the
real stage loop computes with (stage/ports.py's ``Scorer`` and ``Proposer``): logits whose argmax
is the oracle's token (plus a little noise, so that sampling has real distributions to work with),
costs charged to a simulated clock from a ``LatencyProfile``, and a KV-cache contract that is
checked, not assumed: a forward over a cache the loop forgot to cut back is a ``ProtocolError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from pipespec_mpi.simulate.inputs import LatencyProfile
from pipespec_mpi.simulate.ports import SimClock
from pipespec_mpi.stage.ports import ProtocolError

_M64 = (1 << 64) - 1
NOISE_ROWS = 1024


def mix64(x: int) -> int:
    """splitmix64 finaliser: a fast, well-spread 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def unit(x: int) -> float:
    """A hash as a uniform number in [0, 1)."""
    return (mix64(x) >> 11) * (1.0 / (1 << 53))


class TokenOracle:
    """Greedy continuations of every stage, as functions of the prefix (a 64-bit prefix hash).

    Pair j is (stage j -> stage j+1). The target (last stage) continues prefix h with ``T(h)``;
    stage j continues it with stage j+1's token if they agree at h, else with a token of its own
    (never equal to stage j+1's). Agreement at h is Bernoulli(rates[j]) drawn from the hash (so
    the same prefix always gives the same answer), except on the target's own output path at a
    position that ``traces[j]`` records, where the recorded verdict is used. Token ids lie in
    range(vocab); the target emits ``eos`` with probability ``eos_rate`` per prefix (never when
    ``eos`` is None). With ``per_prompt`` every prompt starts its own hash chain (the schedule
    explorer: a proposal applied to the wrong prompt shows); otherwise all prompts share the chain
    that ``canonical``, ``on_path`` and the traces follow (the timed simulator).
    """

    def __init__(
        self,
        rates: Sequence[float],
        traces: Sequence[Mapping[int, bool] | None] | None = None,
        seed: int = 0,
        vocab: int = 64,
        eos: int | None = None,
        eos_rate: float = 0.0,
        per_prompt: bool = False,
    ) -> None:
        for a in rates:
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"acceptance rate {a}: must be in [0, 1]")
        if vocab < 3:
            raise ValueError(f"vocab={vocab}: needs at least 3 token ids")
        self.rates = [float(a) for a in rates]
        self.k = len(self.rates) + 1
        traces = list(traces or [])
        self.traces = traces + [None] * (len(self.rates) - len(traces))
        self.vocab, self.eos, self.eos_rate, self.per_prompt = vocab, eos, eos_rate, per_prompt
        self.root = mix64(0x5EED ^ (seed * 0x100000001B3))
        self._canon_h = [self.root]
        self._canon_tok: list[int] = []
        self._salt = [mix64(0xA11CE + 7919 * j) for j in range(self.k + 2)]
        gen = torch.Generator().manual_seed(seed)
        self.noise = torch.rand(NOISE_ROWS, vocab, generator=gen)  # [R, V] in [0, 1)

    @staticmethod
    def extend(h: int, tok: int) -> int:
        """Hash of the prefix ``h`` followed by ``tok``."""
        return mix64(h ^ ((tok * 0x9E3779B97F4A7C15) & _M64))

    def root_for(self, prompt: Sequence[int]) -> int:
        """The hash before the first generated token of ``prompt``."""
        h = self.root
        if self.per_prompt:
            for tok in prompt:
                h = self.extend(h, tok)
        return h

    def _target(self, h: int) -> int:
        if self.eos is None:
            return mix64(h ^ self._salt[self.k]) % self.vocab
        if unit(h ^ self._salt[self.k + 1]) < self.eos_rate:
            return self.eos
        tok = mix64(h ^ self._salt[self.k]) % (self.vocab - 1)
        return tok + (tok >= self.eos)

    def _canonical_upto(self, pos: int) -> None:
        while len(self._canon_h) <= pos:
            h = self._canon_h[-1]
            tok = self._target(h)
            self._canon_tok.append(tok)
            self._canon_h.append(self.extend(h, tok))

    def canonical(self, n: int) -> list[int]:
        """The target's own greedy output (the AR answer), first ``n`` tokens (EOS not cut)."""
        self._canonical_upto(n)
        return self._canon_tok[:n]

    def on_path(self, h: int, pos: int) -> bool:
        """Whether prefix ``h`` of ``pos`` tokens is the target's own output so far."""
        self._canonical_upto(pos)
        return self._canon_h[pos] == h

    def agree(self, pair: int, h: int, pos: int) -> bool:
        tr = self.traces[pair]
        if tr is not None and pos in tr and self.on_path(h, pos):
            return tr[pos]
        return unit(h ^ self._salt[pair]) < self.rates[pair]

    def token(self, stage: int, h: int, pos: int) -> int:
        """Stage ``stage``'s greedy token after prefix ``h`` (the prefix has ``pos`` tokens)."""
        tok = self._target(h)
        for j in range(self.k - 2, stage - 1, -1):
            if not self.agree(j, h, pos):
                tok = (tok + 1 + mix64(h ^ self._salt[j] ^ 0x0DD) % (self.vocab - 1)) % self.vocab
        return tok

    def logits(self, stage: int, h: int, pos: int) -> torch.Tensor:
        """[V]: the stage's token scores 2 above a noise floor in [0, 1) (argmax = the token)."""
        row = self.noise[mix64(h ^ self._salt[stage]) % NOISE_ROWS].clone()
        row[self.token(stage, h, pos)] += 2.0
        return row


class _Compute:
    """Charges forwards to a simulated clock and remembers when the stage was computing;
    ``prefill``: seconds to prefill a prompt of n tokens (None: free)."""

    def __init__(
        self, profile: LatencyProfile | None, clock: SimClock | None, prefill: Callable[[int], float] | None
    ) -> None:
        self.profile, self.clock, self.prefill_cost = profile, clock, prefill
        self.forwards: list[tuple[float, float]] = []  # (start, end), in time order

    def charge(self, seconds: float) -> None:
        if self.clock is None or seconds <= 0:
            return
        t0 = self.clock.now()
        self.clock.advance(seconds)
        self.forwards.append((t0, self.clock.now()))

    def forward(self, n: int, ctx: int) -> None:
        if self.profile is not None:
            self.charge(self.profile.forward_s(n, ctx))

    def prefill(self, n_prompt: int) -> None:
        if self.prefill_cost is not None:
            self.charge(self.prefill_cost(n_prompt))


class _PrefixHashes:
    """Hashes of the generated prefix, extended and cut back as the sequence changes."""

    def __init__(self, oracle: TokenOracle) -> None:
        self.oracle = oracle
        self.start(())

    def start(self, prompt: Sequence[int]) -> None:
        self.toks: list[int] = []
        self.hs = [self.oracle.root_for(prompt)]

    def of(self, gen: Sequence[int]) -> int:
        """The hash after ``gen``; reuses the longest common prefix with the last one."""
        p = 0
        n = min(len(self.toks), len(gen))
        if self.toks[:n] == list(gen[:n]):
            p = n
        else:
            while self.toks[p] == gen[p]:
                p += 1
        del self.toks[p:]
        del self.hs[p + 1 :]
        for tok in gen[p:]:
            self.toks.append(tok)
            self.hs.append(self.oracle.extend(self.hs[-1], tok))
        return self.hs[-1]


class OracleScorer:
    """Stage ``stage`` of an oracle hierarchy as a ``Scorer``."""

    def __init__(
        self,
        oracle: TokenOracle,
        stage: int,
        name: str = "",
        profile: LatencyProfile | None = None,
        clock: SimClock | None = None,
        prefill: Callable[[int], float] | None = None,
    ) -> None:
        self.oracle, self.stage = oracle, stage
        self.name = name or (profile.name if profile else f"oracle{stage}")
        self.compute = _Compute(profile, clock, prefill)
        self.hashes = _PrefixHashes(oracle)
        self.cache: list[int] = []
        self.prompt_len = 0
        self.vocab_size = oracle.vocab

    def prefill(self, prompt: Sequence[int], room: int = 0) -> None:
        self.prompt_len = len(prompt)
        self.cache = list(prompt[:-1])
        self.hashes.start(prompt)
        self.compute.prefill(len(prompt))

    def logits(self, seq: Sequence[int], proposal: Sequence[int]) -> torch.Tensor:
        seq = list(seq)
        if len(self.cache) >= len(seq):
            raise ProtocolError(f"{self.name}: cache holds {len(self.cache)} >= {len(seq)} positions")
        if self.cache != seq[: len(self.cache)]:
            raise ProtocolError(f"{self.name}: the KV cache holds tokens the sequence no longer has "
                                "(a rollback without a truncate)")  # fmt: skip
        o = self.oracle
        h = self.hashes.of(seq[self.prompt_len :])
        pos = len(seq) - self.prompt_len
        rows = []
        for j in range(len(proposal) + 1):
            rows.append(o.logits(self.stage, h, pos + j))
            if j < len(proposal):
                h = o.extend(h, proposal[j])
        self.cache = seq + list(proposal)
        self.compute.forward(max(1, len(proposal)), len(seq))
        return torch.stack(rows)  # [n+1, V]

    def truncate(self, length: int) -> None:
        del self.cache[length:]

    @property
    def backend(self) -> OracleScorer:
        return self  # an oracle has no batched forward: each scorer alone

    def score_many(
        self, requests: Sequence[tuple[OracleScorer, Sequence[int], Sequence[int]]]
    ) -> list[torch.Tensor]:
        return [sc.logits(seq, proposal) for sc, seq, proposal in requests]


class OracleLookup:
    """Stage 0 as a model-free drafter (``Proposer``): a hit proposes up to ``max_proposal`` of
    the oracle's stage-0 tokens. Whether the n-gram recurs is a property of the context: a miss
    lasts until the context changes; on the target's path, where a recorded lookup was seen to hit
    or miss (``seen``: position -> proposal length, 0 a miss), it does the same."""

    def __init__(
        self,
        oracle: TokenOracle,
        profile: LatencyProfile,
        seen: Mapping[int, int] | None = None,
        clock: SimClock | None = None,
    ) -> None:
        self.oracle, self.profile, self.seen = oracle, profile, seen
        self.name = profile.name
        self.compute = _Compute(profile, clock, None)
        self.hashes = _PrefixHashes(oracle)
        self.prompt_len = 0
        self.chain: tuple[int, int] | None = None  # (length, hash) after the last proposal

    def prefill(self, prompt: Sequence[int], room: int = 0, store_key: str = "") -> None:
        self.prompt_len = len(prompt)
        self.hashes.start(prompt)
        self.chain = None

    def end_sequence(self, output: Sequence[int]) -> dict:
        return {}

    def propose(self, seq: Sequence[int], limit: int, confirmed: int | None = None) -> list[int]:
        o, prof = self.oracle, self.profile
        gen = list(seq[self.prompt_len :])
        h = self.hashes.of(gen)
        pos = len(gen)
        seen = self.seen.get(pos) if self.seen else None
        if seen is not None and not o.on_path(h, pos):
            seen = None
        if seen is None:
            rate = prof.lookup_hit_rate
            if self.chain == (pos, h) and prof.lookup_chain_rate is not None:
                rate = prof.lookup_chain_rate
            if unit(h ^ 0x100C0B) >= rate:
                return []
            seen = prof.max_proposal
        n = min(limit, seen)
        toks: list[int] = []
        for q in range(n):
            tok = o.token(0, h, pos + q)
            toks.append(tok)
            h = o.extend(h, tok)
        if toks:
            self.compute.forward(len(toks), len(seq))
            self.chain = (pos + len(toks), h)
        return toks
