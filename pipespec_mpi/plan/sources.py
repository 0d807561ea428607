"""Where a plan's predictions come from: ``MeasuredSource`` (this node's measured costs and
agreement, each calibration prompt replayed: ``hierarchy=auto``, ``pipespec-plan --measure``) and
``RateSource`` (latency profiles and pairwise rates: a plan file, a past run's fit, the paper's
setting). Both answer the same two questions for ``search``: which pipelines, and how fast."""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipespec_mpi import simulate as sim
from pipespec_mpi.auto.measured import Measured, Pipeline, agreement_rate, lookup_rates, run_trace
from pipespec_mpi.config import CONF_DIR, DRAFTER_KINDS, DecodeConfig, StageConfig, compose_config
from pipespec_mpi.plan.options import Setting
from pipespec_mpi.records import Record
from pipespec_mpi.simulate.fit import fit_run, load_records
from pipespec_mpi.simulate.paper import PAPER_LATENCY_S, PAPER_PROFILES, PAPER_RATES, PaperSetting, paper_ms


# ---------------------------------------------------------------------------------- measured
def profiles(m: Measured, p: Pipeline) -> list[sim.LatencyProfile]:
    out = []
    for s, cost in zip(p, m.costs[p]):
        points = tuple((float(n), t) for n, t in cost.points)
        prefill = cost.prefill_s / cost.context if cost.context else 0.0
        if m.kinds[s] in DRAFTER_KINDS:
            hit, chain = lookup_rates(m.agreement, s)
            out.append(sim.LatencyProfile(
                name=m.stages[s], points=points, kind="lookup", max_proposal=m.max_proposal[s],
                lookup_hit_rate=hit, lookup_chain_rate=chain,
            ))  # fmt: skip
        else:
            out.append(sim.LatencyProfile(name=m.stages[s], points=points, prefill_per_token_s=prefill,
                                          per_sequence_s=cost.per_sequence_s))  # fmt: skip
    return out


def rates(m: Measured, p: Pipeline) -> tuple[float, ...] | None:
    got = [agreement_rate(m.agreement, a, b) for a, b in zip(p, p[1:])]
    return None if any(r is None for r in got) else tuple(float(r) for r in got)


def replay(m: Measured, p: Pipeline, prompt: int, method: str, window: int) -> sim.Acceptance | None:
    """Acceptance for pipeline ``p`` on calibration prompt ``prompt``: per adjacent pair, the
    drafter's verdicts along the path (a model: where its argmax agrees with its verifier's; a
    lookup stage: ``run_trace``), the lookup stage's proposal lengths; i.i.d. rates elsewhere."""
    iid = rates(m, p)
    if iid is None:
        return None
    ag = m.agreement
    traces = []
    for a, b in zip(p, p[1:]):
        theirs = ag.tokens_of(b, prompt)
        if m.kinds[a] in DRAFTER_KINDS:
            traces.append(run_trace(ag.proposals[a][prompt], theirs, method, window))
        else:
            traces.append({i: tok == theirs[i] for i, tok in enumerate(ag.first(a, prompt)) if tok >= 0})
    lookup = None
    if m.kinds[p[0]] in DRAFTER_KINDS:
        lookup = {i: len(run) for i, run in enumerate(ag.proposals[p[0]][prompt])}
    return sim.Acceptance(rates=iid, traces=tuple(traces), lookup=lookup)


def simulated_ms(m: Measured, p: Pipeline, cfg: sim.SimConfig, seeds: Sequence[int]) -> float | None:
    """ms/token of ``p`` over the calibration prompts (each replayed, ``seeds`` times). Batched
    (``cfg.batch_size`` B): B prompts at a time, the calibration prompts taken in turn (B of
    them from prompt j on, for each j), and the time per token is the batch's wall over all its
    slots' tokens (1000 / tokens/s)."""
    profs = profiles(m, p)
    window = cfg.decode.window(cfg.method)
    accs = []
    for k in range(len(m.agreement.paths)):
        acc = replay(m, p, k, cfg.method, window) if len(p) > 1 else sim.Acceptance(rates=())
        if acc is None:
            return None
        accs.append(acc)
    n_prompts, b = len(accs), cfg.batch_size
    wall = tokens = 0.0
    for k in range(n_prompts):
        wave = [(k + j) % n_prompts for j in range(b)]
        n = max(1, *(len(m.agreement.paths[j]) for j in wave))
        prompt_len = m.agreement.prompt_lens[k] if m.agreement.prompt_lens else 0
        for s in seeds:
            decode = replace(cfg.decode, max_new_tokens=n)
            run = replace(cfg, decode=decode, seed=s, prompt_len=prompt_len, include_prefill=bool(prompt_len))
            r = sim.simulate(profs, accs[k] if b == 1 else [accs[j] for j in wave], run)
            wall += r.wall_s
            tokens += sum(x.n_tokens for x in r.slots) if r.slots else r.n_tokens
    return 1000.0 * wall / tokens


@dataclass(frozen=True)
class MeasuredSource:
    """Predictions from this node's measurements: every calibration prompt replayed (``seeds``
    times; only off-path verdicts are drawn), each pipeline with the threads its ranks get."""

    measured: Measured
    seeds: tuple[int, ...] = (0,)

    @property
    def target(self) -> str:
        return self.measured.stages[-1]

    @property
    def threads(self) -> Mapping[int, int]:
        return dict(self.measured.threads)

    def pipelines(self, max_stages: int) -> list[tuple[str, ...]]:
        m = self.measured
        return [tuple(m.stages[i] for i in p) for p in m.costs
                if 2 <= len(p) <= max_stages and rates(m, p) is not None]  # fmt: skip

    def ms(self, pipeline: tuple[str, ...], setting: Setting, decode: DecodeConfig) -> float:
        p = tuple(self.measured.stages.index(name) for name in pipeline)
        d = setting.decode(decode)
        if setting.batch_size > 1 and setting.method != "ar":
            d = d.for_batch(setting.batch_size)
        cfg = sim.SimConfig(
            decode=d, include_prefill=False, method=setting.method, batch_size=setting.batch_size
        )
        return simulated_ms(self.measured, p, cfg, self.seeds[:1] if setting.method == "ar" else self.seeds)


# ---------------------------------------------------------------------------------- rates
@dataclass(frozen=True)
class PlanInputs:
    models: dict[str, sim.LatencyProfile]
    rates: dict[tuple[str, str], float]
    target: str
    latency_s: float = 0.0
    up_latency_s: float | None = None
    blocking_reads: bool = False
    hierarchy: str | None = None  # conf/hierarchy/<name>.yaml for the overrides
    stage_defs: dict[str, StageConfig] | None = None  # model name -> its stage in that hierarchy
    source: str = ""
    # the paper's models: predicted as ``pipespec-simulate --preset paper`` predicts them
    # (simulate/paper.py, paper_ms), not with i.i.d. rates
    paper: PaperSetting | None = None
    # the target's profile where it computes alone (AR), where a run measured it apart: AR takes
    # the CPUs its idle stages leave (host/placement.py CpuShare.solo), so its steps are not the pipeline's
    alone: sim.LatencyProfile | None = None


def _profile_from_config(name: str, node: Mapping) -> sim.LatencyProfile:
    fwd = node.get("forward_ms")
    if isinstance(fwd, Mapping):
        points = tuple((float(n), float(ms) / 1000) for n, ms in fwd.items())
    elif isinstance(fwd, (int, float)):
        points = ((1.0, float(fwd) / 1000),)
    else:
        raise ValueError(f"models.{name}.forward_ms: a number or a mapping n_tokens -> ms")
    return sim.LatencyProfile(
        name=name,
        points=points,
        overhead_s=float(node.get("overhead_ms", 0.0)) / 1000,
        prefill_per_token_s=float(node.get("prefill_ms_per_token", 0.0)) / 1000,
        kind=str(node.get("kind", "model")),
        max_proposal=int(node.get("max_proposal", 8)),
        lookup_hit_rate=float(node.get("lookup_hit_rate", 1.0)),
    )


def _parse_pair(key: str) -> tuple[str, str]:
    if "->" not in key:
        raise ValueError(f"acceptance key {key!r}: write 'drafter -> verifier'")
    a, b = (x.strip() for x in key.split("->", 1))
    return a, b


def hierarchy_presets() -> list[str]:
    """The options of the ``hierarchy`` config group (conf/hierarchy/)."""
    return sorted(p.stem for p in (CONF_DIR / "hierarchy").glob("*.yaml"))


def stage_defs_of(hierarchy: str | None) -> dict[str, StageConfig] | None:
    """The stages of a ``hierarchy`` preset by name, as the app composes them."""
    if not hierarchy or hierarchy not in hierarchy_presets():
        return None
    return {st.name: st for st in compose_config([f"hierarchy={hierarchy}"]).hierarchy.stages}


def load_plan_config(path: str | Path) -> PlanInputs:
    text = Path(path).read_text()
    if str(path).endswith(".json"):
        node = json.loads(text)
    else:
        import yaml

        node = yaml.safe_load(text)
    models = {n: _profile_from_config(n, m or {}) for n, m in (node.get("models") or {}).items()}
    if not models:
        raise ValueError(f"{path}: 'models' is empty")
    rates = {_parse_pair(k): float(v) for k, v in (node.get("acceptance") or {}).items()}
    target = node.get("target") or max(models, key=lambda n: models[n].forward_s(1))
    if target not in models:
        raise ValueError(f"{path}: target {target!r} is not among the models")
    hier = node.get("hierarchy")
    return PlanInputs(
        models=models,
        rates=rates,
        target=target,
        latency_s=float(node.get("latency_ms", 0.0)) / 1000,
        blocking_reads=bool(node.get("blocking_reads", False)),
        hierarchy=hier,
        stage_defs=stage_defs_of(hier),
        source=str(path),
    )


def inputs_from_run(run_dir: str | Path) -> PlanInputs:
    """Profiles, adjacent-pair rates and latencies measured in a run (its PipeSpec records if
    any, else SD, else AR); AR's target from its own records where the run has them (batch 1
    where it has those): AR's target computes alone on the node's cores, so it steps faster than
    the pipeline's (docs/notebook.md, "Measurements behind the code's choices")."""
    recs = load_records(run_dir)
    by: dict[str, list[Record]] = {}
    for r in recs:
        by.setdefault(r.method, []).append(r)
    method = next((m for m in ("pipespec", "sd", "ar") if m in by), None)
    if method is None:
        raise ValueError(f"{run_dir}: no records")
    fit = fit_run(by[method])
    names = [p.name for p in fit.profiles]
    models = {p.name: p for p in fit.profiles}
    rates = {(a, b): r for a, b, r in zip(names, names[1:], fit.rates)}
    hier = by[method][0].hierarchy
    alone = None
    if method != "ar" and "ar" in by:
        ar = [r for r in by["ar"] if r.batch_size == 1] or by["ar"]
        alone = fit_run(ar).profiles[-1]
    lat = sum(fit.down_latency_s) / len(fit.down_latency_s) if fit.down_latency_s else 0.0
    up = sum(fit.up_latency_s) / len(fit.up_latency_s) if fit.up_latency_s else None
    return PlanInputs(
        models=models,
        rates=rates,
        target=names[-1],
        latency_s=lat,
        up_latency_s=up,
        blocking_reads=False,  # header reads of the shared-memory epochs window never wait
        hierarchy=hier,
        stage_defs=stage_defs_of(hier),
        source=f"{run_dir} ({method} records" + (", AR's target from its own)" if alone else ")"),
        alone=alone,
    )


PAPER_HIERARCHY = "llama3_1b_8b_70b"
PAPER_STAGE_NAMES = {"1B": "llama-3.2-1b", "8B": "llama-3.1-8b", "70B": "llama-3.1-70b"}


def paper_inputs(blocking_reads: bool = False) -> PlanInputs:
    """The paper's models (simulate/paper.py), predicted in the paper's setting (``PaperSetting``:
    the authors' acceptance traces, uncapped bounds) so that every configuration gets the number
    ``pipespec-simulate --preset paper`` prints for it; overrides for the Llama preset."""
    defs = stage_defs_of(PAPER_HIERARCHY) or {}
    stage_defs = {k: defs[v] for k, v in PAPER_STAGE_NAMES.items() if v in defs}
    return PlanInputs(
        models=dict(PAPER_PROFILES),
        rates=dict(PAPER_RATES["trace"]),
        target="70B",
        latency_s=PAPER_LATENCY_S,
        blocking_reads=blocking_reads,
        hierarchy=PAPER_HIERARCHY if len(stage_defs) == 3 else None,
        stage_defs=stage_defs if len(stage_defs) == 3 else None,
        source="the paper's setting (simulate/paper.py: the authors' acceptance traces, as pipespec-simulate "
        "--preset paper)",
        paper=PaperSetting(blocking_reads=blocking_reads),
    )


def pair_rate(rates: Mapping[tuple[str, str], float], a: str, b: str, transitive: bool) -> float | None:
    if (a, b) in rates:
        return rates[(a, b)]
    if transitive:
        via = [rates[(a, m)] * rates[(m, b)] for (x, m) in rates if x == a and (m, b) in rates]
        if via:
            return max(via)
    return None


def hierarchies(
    inp: PlanInputs, max_stages: int, transitive: bool
) -> list[tuple[tuple[str, ...], tuple[float, ...]]]:
    """Every ordered choice of distinct drafters before the target with known pair rates; a
    lookup (model-free) drafter can only come first."""
    others = [m for m in inp.models if m != inp.target]
    out = []
    for k in range(0, max_stages):
        for drafters in itertools.permutations(others, k):
            models = (*drafters, inp.target)
            if any(inp.models[m].kind == "lookup" for m in models[1:]):
                continue
            rates = [pair_rate(inp.rates, a, b, transitive) for a, b in zip(models, models[1:])]
            if any(r is None for r in rates):
                continue
            out.append((models, tuple(float(r) for r in rates)))
    return out


@dataclass
class RateSource:
    """Predictions from latency profiles and pairwise rates (i.i.d. acceptance), or, for the
    paper's models, exactly as ``pipespec-simulate --preset paper`` predicts them (``paper_ms``).
    ``transitive``: a missing rate a -> c estimated through a known b (a lower bound)."""

    inputs: PlanInputs
    seeds: tuple[int, ...] = (0, 1, 2)
    transitive: bool = False
    threads: Mapping[int, int] = field(default_factory=dict)

    @property
    def target(self) -> str:
        return self.inputs.target

    def pipelines(self, max_stages: int) -> list[tuple[str, ...]]:
        found = hierarchies(self.inputs, max_stages, self.transitive)
        return [models for models, _ in found if len(models) >= 2]

    def ms(self, pipeline: tuple[str, ...], setting: Setting, decode: DecodeConfig) -> float:
        inp, d = self.inputs, setting.decode(decode)
        if inp.paper:
            paper = replace(
                inp.paper, n_tokens=d.max_new_tokens, seeds=self.seeds, max_run_ahead=d.max_run_ahead,
                max_verify=d.max_verify, blocking_reads=inp.blocking_reads,
            )  # fmt: skip
            return paper_ms(setting.method, pipeline, setting.window, setting.policy, paper)
        cfg = sim.SimConfig(
            decode=d, method=setting.method, latency_s=inp.latency_s, up_latency_s=inp.up_latency_s,
            blocking_reads=inp.blocking_reads, include_prefill=False,
        )  # fmt: skip
        profs = [inp.models[m] for m in pipeline]
        if setting.method == "ar" and inp.alone is not None and pipeline == (inp.target,):
            profs = [inp.alone]
        seeds = self.seeds[:1] if setting.method == "ar" else self.seeds
        rates = tuple(pair_rate(inp.rates, a, b, self.transitive) for a, b in zip(pipeline, pipeline[1:]))
        return sim.mean_ms_per_token(profs, rates, cfg, seeds)
