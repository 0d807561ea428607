"""The paper's setting (McDanel et al., ACL Findings 2025): profiles, acceptance, results.

Llama 3 on A100-40GB, HumanEval, greedy (McDanel et al., Table; /work/shared/PIPESPEC.md).
Forward times: AR ms/token from the paper (70B: 123.69, 8B: 22.46) less 1 ms of loop overhead;
the rest is derived from the authors' published per-forward times (benchmark_results/humaneval
in github.com/BradMcDanel/pipespec): the 4-bit (bitsandbytes NF4) 70B takes ~0.12 s for a
one-token forward but ~0.43 s for any multi-token forward (2..35 tokens: dequantisation
dominates); the 8B verifying 2-4 tokens ~26.5 ms; the 1B ~11.5 ms per token (its AR run:
11.53 ms/token). Beyond the observed token counts the profiles are estimates (flat-ish: these
GPUs are memory bound at small n). Loop overhead and per-message latency (shared-memory
tensors polled by the reference code) are assumed: 1 ms each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from pipespec_mpi.analysis.analytical import bisect_increasing
from pipespec_mpi.config import DecodeConfig
from pipespec_mpi.simulate.engine import mean_ms_per_token, simulate
from pipespec_mpi.simulate.inputs import Acceptance, LatencyProfile, SimConfig

PAPER_OVERHEAD_S = 0.001
PAPER_LATENCY_S = 0.001
PAPER_PROFILES: dict[str, LatencyProfile] = {
    "1B": LatencyProfile("Llama-3.2-1B", ((1, 0.0105), (40, 0.0130)), overhead_s=PAPER_OVERHEAD_S),
    "8B": LatencyProfile(
        "Llama-3.1-8B", ((1, 0.02146), (4, 0.0265), (40, 0.040)), overhead_s=PAPER_OVERHEAD_S
    ),
    "70B": LatencyProfile(
        "Llama-3.1-70B-NF4", ((1, 0.12269), (2, 0.427), (40, 0.436)), overhead_s=PAPER_OVERHEAD_S
    ),
}
# Acceptance. The authors' result files record, for every target forward, how many tokens it
# committed ("accepted_tokens"). For the same prompt the greedy output is fixed, so those lists
# are per-position agreement traces of the pair along the target's output: c committed = c - 1
# agreements then a disagreement (taken as a rejection, not a bonus). Sample 9 (HumanEval
# "rolling_max", lookahead 0, async-chain_*.json) for the two pairs that end at the 70B:
PAPER_COMMITTED: dict[tuple[str, str], tuple[int, ...]] = {
    ("8B", "70B"): (
        4,
        5,
        18,
        19,
        19,
        10,
        4,
        5,
        13,
        5,
        8,
        5,
        2,
        5,
        2,
        5,
        2,
        5,
        18,
        2,
        5,
        18,
        19,
        9,
        5,
    ),  # fmt: skip
    ("1B", "70B"): (4, 5, 33, 5, 27, 4, 1, 5, 4, 5, 4, 4, 5, 11, 5, 8, 1, 5, 34, 19, 5),
}
# What the same sample says per target (or middle) forward: the tokens it committed on average,
# which the acceptance below is fitted to reproduce in the simulated PipeSpec (``fit_paper_rates``).
PAPER_COMMITTED_PER_FORWARD: dict[tuple[str, ...], tuple[int, float]] = {
    # hierarchy: (stage whose forwards are counted, committed tokens per forward)
    ("8B", "70B"): (1, 212 / 25),  # 8.48
    ("1B", "70B"): (1, 194 / 21),  # 9.24
    ("1B", "8B", "70B"): (1, 513 / 170),  # 3.02 per 8B forward
}
# Rates fitted by fit_paper_rates() (lookahead 4, 8 seeds; ``--fit-paper-rates``): "trace" mode,
# the probability that the drafter's token agrees where the trace has no verdict (the last token
# of each verification: a correction, or a bonus the drafter may have matched); "iid" mode, the
# i.i.d. acceptance for every position.
PAPER_RATES: dict[str, dict[tuple[str, str], float]] = {
    "trace": {("8B", "70B"): 0.512, ("1B", "70B"): 0.393, ("1B", "8B"): 0.757},
    "iid": {("8B", "70B"): 0.941, ("1B", "70B"): 0.941, ("1B", "8B"): 0.76},
}
# The reference verifier publishes its output, waits for the drafter to acknowledge a rollback
# and for two drafts beyond its output, then verifies everything pending and never takes a step
# of its own. In this simulator, which runs this project's stage loop, that is PipeSpec with a
# lookahead and no caps (max_verify = max_run_ahead = 64); lookahead 4 reproduces the authors'
# tokens per forward best (their targets commit 4-5 tokens right after a rollback, and only
# lookahead >= 3 reproduces the 3-stage 8B's 3.02 tokens per forward), see docs/simulator.md.
PAPER_PIPESPEC_LOOKAHEAD = 4
PAPER_SD_WINDOW = 8
# the paper's reported results (ms/token), for comparison in the printed table
PAPER_TABLE: dict[tuple[str, tuple[str, ...]], float] = {
    ("ar", ("70B",)): 123.69,
    ("sd", ("8B", "70B")): 93.42,
    ("sd", ("1B", "8B", "70B")): 90.14,
    ("sd", ("1B", "70B")): 84.72,
    ("pipespec", ("1B", "70B")): 54.85,
    ("pipespec", ("8B", "70B")): 54.52,
    ("pipespec", ("1B", "8B", "70B")): 48.76,
}


def paper_rates(models: Sequence[str], rates: Mapping[tuple[str, str], float]) -> tuple[float, ...]:
    """Per-pair rates for a hierarchy of the paper's models (KeyError for an unknown pair)."""
    out = []
    for a, b in zip(models, models[1:]):
        if (a, b) not in rates:
            raise KeyError(f"no acceptance rate for the pair {a} -> {b}")
        out.append(rates[(a, b)])
    return tuple(out)


def fit_rate(metric: Callable[[float], float], target: float, lo: float = 0.01, hi: float = 0.999) -> float:
    """The rate at which an increasing ``metric(rate)`` reaches ``target`` (bisection, 30 halvings)."""
    return bisect_increasing(metric, target, lo, hi, steps=30)


def committed_to_trace(committed: Sequence[int], boundary: bool | None = None) -> dict[int, bool]:
    """Per-position agreement from a list of tokens committed per verification: c - 1
    agreements, then the verifier's own token, which was either a correction (the drafter
    disagreed) or a bonus after all pending drafts (the drafter's next token may have agreed):
    ``boundary`` says which; None leaves those positions out (the pair's rate decides)."""
    trace: dict[int, bool] = {}
    pos = 0
    for c in committed:
        for q in range(int(c) - 1):
            trace[pos + q] = True
        if boundary is not None:
            trace[pos + int(c) - 1] = boundary
        pos += int(c)
    return trace


PAPER_RUNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ar", ("70B",)),
    ("sd", ("8B", "70B")),
    ("sd", ("1B", "8B", "70B")),
    ("sd", ("1B", "70B")),
    ("pipespec", ("1B", "70B")),
    ("pipespec", ("8B", "70B")),
    ("pipespec", ("1B", "8B", "70B")),
)


def paper_acceptance(
    models: Sequence[str],
    mode: str = "trace",
    rates: Mapping[tuple[str, str], float] | None = None,
) -> tuple[Acceptance, int | None]:
    """Acceptance for a hierarchy of the paper's models, and the trace length (tokens) if any."""
    if mode not in ("trace", "iid"):
        raise ValueError(f"acceptance mode {mode!r}: trace | iid")
    rates = dict(PAPER_RATES[mode] if rates is None else rates)
    pairs = list(zip(models, models[1:]))
    per_pair = paper_rates(models, rates)
    if mode == "iid":
        return Acceptance(per_pair), None
    traces = tuple(committed_to_trace(PAPER_COMMITTED[p]) if p in PAPER_COMMITTED else None for p in pairs)
    lengths = [sum(PAPER_COMMITTED[p]) for p in pairs if p in PAPER_COMMITTED]
    return Acceptance(per_pair, traces), (min(lengths) if lengths else None)


def _paper_cfg(
    method: str,
    look: int,
    n: int,
    max_run_ahead: int,
    max_verify: int,
    latency_s: float,
    policy: str = "static",
    draft_survival: float = 0.0,
) -> SimConfig:
    decode = DecodeConfig(
        lookahead=look, sd_window=None, max_new_tokens=n, max_run_ahead=max_run_ahead, max_verify=max_verify,
        policy=policy, draft_survival=draft_survival,
    )  # fmt: skip
    return SimConfig(method=method, decode=decode, latency_s=latency_s, include_prefill=False)


def fit_paper_rates(
    mode: str = "trace",
    seeds: Sequence[int] = tuple(range(8)),
    n_tokens: int = 256,
    lookahead: int = PAPER_PIPESPEC_LOOKAHEAD,
    max_run_ahead: int = 64,
    max_verify: int = 64,
) -> dict[tuple[str, str], float]:
    """Fit PAPER_RATES[mode]: each pair's rate so that the simulated PipeSpec commits as many
    tokens per forward as the authors' sample (PAPER_COMMITTED_PER_FORWARD); the 2-stage
    hierarchies first, then 1B -> 8B inside the 3-stage one."""
    rates = dict(PAPER_RATES[mode])

    def committed(models: tuple[str, ...], stage: int, trial: dict) -> float:
        acc, n_trace = paper_acceptance(models, mode, trial)
        cfg = _paper_cfg("pipespec", lookahead, n_trace or n_tokens, max_run_ahead, max_verify,
                         PAPER_LATENCY_S)  # fmt: skip
        tok = fw = 0
        for sd in seeds:
            r = simulate([PAPER_PROFILES[m] for m in models], acc, replace(cfg, seed=sd))
            st = r.stages[stage]
            tok += r.n_tokens if stage == len(models) - 1 else st.tokens_generated
            fw += st.forward_calls
        return tok / fw

    for models in (("8B", "70B"), ("1B", "70B"), ("1B", "8B", "70B")):
        stage, target = PAPER_COMMITTED_PER_FORWARD[models]
        pair = (models[stage - 1], models[stage])

        def metric(a: float, models=models, stage=stage, pair=pair) -> float:
            return committed(models, stage, {**rates, pair: a})

        rates[pair] = round(fit_rate(metric, target), 3)
    return rates


@dataclass(frozen=True)
class PaperSetting:
    """How a prediction in the paper's setting is simulated: the one home of these defaults, read
    by ``pipespec-simulate --preset paper`` and ``pipespec-plan --preset paper`` alike, so that
    the two print the same number for the same (method, models, window).

    acceptance="trace" replays the authors' recorded acceptance along the target's output (and
    simulates that many tokens); "iid" uses the per-pair rates for ``n_tokens`` tokens. The caps
    are the reference verifier's (none: 64). ``draft_survival``: decode.draft_survival under the
    adaptive policy (0 here, each stage on a GPU of its own, where a draft that may be thrown
    away costs no neighbour)."""

    n_tokens: int = 256
    seeds: tuple[int, ...] = tuple(range(8))
    max_run_ahead: int = 64
    max_verify: int = 64
    acceptance: str = "trace"
    rates: Mapping[tuple[str, str], float] | None = None
    latency_s: float = PAPER_LATENCY_S
    profiles: Mapping[str, LatencyProfile] | None = None
    blocking_reads: bool = False
    draft_survival: float = 0.0
    batch_size: int = 1  # sequences decoded at once, every stage's forwards batched


def paper_ms(method: str, models: Sequence[str], window: int, policy: str = "static",
             setting: PaperSetting = PaperSetting()) -> float:  # fmt: skip
    """Predicted ms/token of one configuration of the paper's models: ``window`` is SD's window
    or PipeSpec's lookahead (unused by AR and by the adaptive policy)."""
    profiles = dict(PAPER_PROFILES if setting.profiles is None else setting.profiles)
    if len(models) > 1:
        acc, n_trace = paper_acceptance(models, setting.acceptance, setting.rates)
    else:
        acc, n_trace = Acceptance(()), None
    look = 0 if method == "ar" else window
    cfg = _paper_cfg(method, look, n_trace or setting.n_tokens, setting.max_run_ahead, setting.max_verify,
                     setting.latency_s, policy, setting.draft_survival)  # fmt: skip
    cfg = replace(cfg, blocking_reads=setting.blocking_reads, batch_size=setting.batch_size)
    return mean_ms_per_token([profiles[m] for m in models], acc, cfg, setting.seeds)


def paper_rows(
    setting: PaperSetting = PaperSetting(),
    sd_window: int = PAPER_SD_WINDOW,
    pipespec_lookahead: int = PAPER_PIPESPEC_LOOKAHEAD,
    policy: str = "static",
) -> list[dict]:
    """AR, SD and PipeSpec over the paper's hierarchies (PAPER_RUNS), in the paper's setting.
    ``policy``: PipeSpec's decisions (decode.policy)."""
    rows = []
    ar_ms = None
    for method, models in PAPER_RUNS:
        window = {"ar": 0, "sd": sd_window, "pipespec": pipespec_lookahead}[method]
        ms = paper_ms(method, models, window, policy if method == "pipespec" else "static", setting)
        if method == "ar":
            ar_ms = ms
        rows.append(
            {
                "method": method,
                "models": list(models),
                "speedup": ar_ms / ms if ar_ms else float("nan"),
                "ms_per_token": ms,
            }
        )
    return rows
