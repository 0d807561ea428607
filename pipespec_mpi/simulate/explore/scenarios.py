"""The explorer's scenarios: families, the configuration and schedule drawn from a family and
seed (``Scenario.draw``), presets, and a run's ``Finding``."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from pipespec_mpi.config import DecodeConfig, SamplingConfig, validate_decode
from pipespec_mpi.config.schema import Policy
from pipespec_mpi.speculative.sampling import Sampler, mix
from pipespec_mpi.speculative.verifiers import Verifier
from pipespec_mpi.stage.batch import ScoreBatch, score_alone
from pipespec_mpi.stage.ports import Proposer, Scorer

METHODS = ("sd", "pipespec")
RULES = ("greedy", "gumbel", "leviathan")
# "-batch": every stage decodes 2-4 sequences at once (slots, stage/batch.py), each over its own
# window, links, gate and handoff, their forwards run together
# "-suffix": stage 0 is the real suffix drafter (models/suffix.py; a batched stage's slots share its
# store) and whether its verifier waits for it (decode.wait_for_drafter) is drawn; families of
# their own, so that every seed of the older families keeps its scenario
# "-adaptive": PipeSpec under decode.policy=adaptive (speculative/goodput.py), its estimates learned
# on drifting clocks (DriftClock) or drawn anew at every decision (ChaosEstimates), so that waits,
# cut verifications and held drafters follow the seed; slots, the suffix drafter, budgets and the
# policy's own settings drawn apart
# "-nccl": as "-batch", over links as NCCL and the strict transport carry them (comm/mux.py):
# one FIFO link per stage pair for every slot, the slot in each message, its send buffers shared
FAMILIES = (
    tuple(f"{m}-{r}{b}" for b in ("", "-batch", "-suffix") for m in METHODS for r in RULES)
    + tuple(f"pipespec-{r}-adaptive" for r in RULES)
    + tuple(f"{m}-{r}-nccl" for m in METHODS for r in RULES)
)
EOS = 0
IDLE_TICKS = 40  # waiting steps in a row before the scheduler checks for a stall
FAIR_ROUNDS = 3  # rounds of every stage with full information that must show some progress


# ============================================================================ scenarios
@dataclass(frozen=True)
class Scenario:
    """One configuration and one schedule, drawn from (family, seed)."""

    family: str
    seed: int
    k: int
    lookup: bool  # stage 0 is a prompt lookup
    decode: DecodeConfig
    n_prompts: int
    rates: tuple[float, ...]  # agreement of stage j with stage j+1
    vocab: int
    eos_rate: float
    depth: int  # messages a link holds before its sender has to wait for a free buffer
    msg_tokens: int  # tokens per message
    speeds: tuple[float, ...]  # relative chance of each stage to be stepped
    p_deliver: float  # chance per tick that one more message becomes deliverable
    p_fresh: float  # chance that a header read sees the newest version
    starve: bool  # now and then one stage is hardly stepped for a long window
    bursts: bool  # now and then a link's messages are held back, then all delivered
    gate_delay: int  # polls after the gate opens until a stage passes it (at most)
    handoff_delay: int  # polls until a handoff is taken (at most)
    temperature: float = 1.0  # gumbel and leviathan
    top_k: int = 0
    # A stop request (run/drain.py): stage i asks to stop before job stop_before + stop_lag[i];
    # the replica's vote at the gate stops every stage before the first job any of them asks to.
    stop_before: int | None = None
    stop_lag: tuple[int, ...] = ()
    slots: int = 1  # sequences in flight per stage (the "-batch" families: 2-4)
    suffix: bool = False  # stage 0 is the real suffix drafter (the "-suffix" families)
    # its min_survival (drawn apart): above 0 it cuts drafts by its learned estimates, holds them
    # back on top of unlikely unconfirmed drafts and reopens shut cells, so it goes idle and back
    drafter_survival: float = 0.0
    # per prompt: its own token budget (a row's max_tokens), None for decode.max_new_tokens
    # (drawn in the "-batch" and "-suffix" families only, apart from every other field)
    budgets: tuple[int | None, ...] = ()
    # "-adaptive" families: the adaptive policy reads estimates that are anything at every decision
    # (ChaosEstimates), so that every order of the decisions it can take is explored
    chaos: bool = False
    # "-nccl" families: the slots share one link per stage pair (comm/mux.py), depth x slots buffers
    one_link: bool = False

    def budget(self, seq: int) -> int:
        """Prompt ``seq``'s token budget (1-based, as the jobs are numbered)."""
        own = self.budgets[seq - 1] if seq - 1 < len(self.budgets) else None
        return own or self.decode.max_new_tokens

    @property
    def method(self) -> str:
        return self.family.split("-")[0]

    @property
    def rule(self) -> str:
        return self.family.split("-")[1]

    @classmethod
    def draw(cls, family: str, seed: int, preset: str | None = None, **fixed) -> Scenario:
        """The scenario of (family, seed); a ``preset`` (PRESETS) or ``fixed`` fields set part of
        the configuration and leave the rest, and the schedule, to the seed."""
        if family not in FAMILIES:
            raise ValueError(f"family {family!r}: one of {', '.join(FAMILIES)}")
        rng = random.Random(f"scenario:{family}:{seed}")
        method = family.split("-")[0]
        k = rng.choice((2, 3, 3, 4))
        lookahead = rng.randint(0, 4)
        sd_window = None
        if method == "sd":
            sd_window = rng.choice((None, 1, 2, 3, 4))
            if sd_window is None:
                lookahead = max(1, lookahead)
        w = max(1, lookahead, sd_window or 0)
        decode = DecodeConfig(
            lookahead=lookahead,
            sd_window=sd_window,
            max_new_tokens=rng.randint(3, 24),
            max_run_ahead=rng.choice([x for x in (1, 2, 3, 4, 6, 8, 16) if x >= w]),
            max_verify=rng.choice((w, w + 1, max(w, 4), 16)),
            policy=Policy.static,  # the "-adaptive" families set their own, below
            batch_verify_rows=16,  # the "-batch" families' row budget (conf/tuning/cpu_few_cores.yaml)
        )
        fixed = {**(PRESETS[preset] if preset else {}), **fixed}
        k = fixed.get("k", k)
        decode = fixed.get("decode", decode)
        problems = validate_decode(decode, sd_needed=method == "sd")
        if problems:
            raise AssertionError(f"{family}:{seed} drew an invalid configuration: {problems}")
        sc = cls(
            family=family,
            seed=seed,
            k=k,
            lookup=rng.random() < 0.3,
            decode=decode,
            n_prompts=rng.randint(1, 3),
            rates=tuple(rng.choice((0.0, 1.0, rng.random(), rng.random())) for _ in range(k - 1)),
            vocab=rng.choice((5, 8, 16, 64)),
            eos_rate=rng.choice((0.0, 0.0, 0.03, 0.1)),
            depth=rng.choice((1, 2, 8)),
            msg_tokens=rng.choice((1, 2, 4, 32)),
            speeds=tuple(rng.choice((0.05, 0.3, 1.0, 1.0, 3.0)) for _ in range(k)),
            p_deliver=rng.choice((0.05, 0.3, 1.0)),
            p_fresh=rng.choice((0.1, 0.5, 0.9, 1.0)),
            starve=rng.random() < 0.3,
            bursts=rng.random() < 0.3,
            gate_delay=rng.choice((0, 3, 30)),
            handoff_delay=rng.choice((0, 3, 30)),
        )
        if family.endswith(("-batch", "-nccl")):
            b = random.Random(f"slots:{family}:{seed}")
            slots = b.randint(2, 4)
            sc = replace(sc, slots=slots, n_prompts=b.randint(slots, 2 * slots + 1))
            sc = replace(sc, one_link=family.endswith("-nccl"))
        # drawn apart from the rest, so that every other field of a seed is what it was before
        stop = random.Random(f"stop:{family}:{seed}")
        if stop.random() < 0.25:
            sc = replace(sc, stop_before=stop.randint(1, sc.n_prompts),
                         stop_lag=tuple(stop.choice((0, 0, 1)) for _ in range(sc.k)))  # fmt: skip
        if family.endswith("-suffix"):  # the suffix drafter, and whether its verifier waits for it
            dr = random.Random(f"drafter:{family}:{seed}")
            sc = replace(sc, lookup=True, suffix=True)
            if "decode" not in fixed:
                sc = replace(sc, decode=replace(sc.decode, wait_for_drafter=dr.random() < 0.7))
        if family.endswith("-adaptive"):
            ad = random.Random(f"adaptive:{family}:{seed}")
            if ad.random() < 0.4:
                slots = ad.randint(2, 4)
                sc = replace(sc, slots=slots, n_prompts=ad.randint(slots, 2 * slots + 1))
            if ad.random() < 0.3:
                sc = replace(sc, lookup=True, suffix=True)
            if "decode" not in fixed:
                policy = dict(policy=Policy.adaptive, draft_survival=ad.choice((0.0, 0.3, 0.5, 0.9)),
                              accept_prior=ad.choice((0.0, 0.5, 1.0, ad.random())),
                              estimate_rate=ad.choice((0.05, 0.3, 1.0)))  # fmt: skip
                sc = replace(sc, decode=replace(sc.decode, **policy))
            sc = replace(sc, chaos=ad.random() < 0.5)
        if sc.suffix:
            sv = random.Random(f"survival:{family}:{seed}")
            if sv.random() < 0.5:
                sc = replace(sc, drafter_survival=sv.choice((0.05, 0.1, 0.3, 0.6)))
        if family.endswith(("-batch", "-suffix", "-adaptive", "-nccl")):
            bu = random.Random(f"budgets:{family}:{seed}")
            if bu.random() < 0.5:
                top = sc.decode.max_new_tokens
                sc = replace(
                    sc, budgets=tuple(bu.choice((None, 1, bu.randint(1, top))) for _ in range(sc.n_prompts))
                )
        return replace(sc, **{k: v for k, v in fixed.items() if k not in ("k", "decode")})

    def stop_requested(self, stage: int, seq: int) -> bool:
        return self.stop_before is not None and seq >= self.stop_before + self.stop_lag[stage]

    def sampler(self, seq: int) -> Sampler:
        if self.rule == "greedy":
            return Sampler()
        key = mix(self.seed, seq)
        return Sampler(
            SamplingConfig(temperature=self.temperature, top_k=self.top_k, coupling=self.rule), key
        )


# Fixed configurations, explored under every schedule the seeds draw. "slurm-sweep" is the job of
# the Slurm sweep test that once stalled (tiny hierarchy, lookahead 2, max_run_ahead 8, 16 tokens).
PRESETS: dict[str, dict] = {
    "slurm-sweep": dict(
        k=3,
        lookup=False,
        n_prompts=2,
        decode=DecodeConfig(lookahead=2, max_run_ahead=8, max_new_tokens=16, policy=Policy.static),
    ),
}


@dataclass(frozen=True)
class Finding:
    family: str
    seed: int
    verdict: str  # ok | stall | livelock | error | mismatch | counter | unrung
    detail: str = ""
    ticks: int = 0

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


@dataclass(frozen=True)
class ExJob:
    seq: int
    prompt_ids: list[int]
    method: str
    max_new_tokens: int | None = None

    @property
    def store_key(self) -> str:
        return self.method

    def runs_on(self, stage: int) -> bool:
        return True  # every stage decodes (an AR job's others idle by its method)


@dataclass(frozen=True)
class Parts:
    """What the stages compute with, when not the scenario's oracle: a model per stage (a fresh
    one per call), the prompts (one job each) and EOS; ``wrap`` replaces every stage's verifier
    and ``score`` runs a batched stage's forwards (broken ones, for the tests that must catch
    them; real models batched: tests/unit/stage/test_batch.py)."""

    model: Callable[[int], Scorer | Proposer]
    prompts: list[list[int]]
    eos: int
    wrap: Callable[[Verifier], Verifier] | None = None
    score: ScoreBatch = score_alone  # a batched stage's forwards (the "-batch" families)
