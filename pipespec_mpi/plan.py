"""Planner: predict the best AR, SD and PipeSpec configurations with the simulator.

  pipespec-plan                      # the paper's models (simulate/paper.py)
  pipespec-plan --config plan.yaml   # your latency profiles and acceptance rates
  pipespec-plan --from RUN_DIR       # profiles and rates measured in a run
  pipespec-plan --measure [--force] [--ranks 3] [OVERRIDES]
                                                   # measure here, as hierarchy=auto does

It searches hierarchies (every ordered choice of distinct drafters in front of the target: subsets
and orderings of the available models), SD windows and PipeSpec lookaheads, simulates each with
i.i.d. acceptance (pipespec_mpi/simulate/) and prints the best configurations per method with
their predicted speedup over AR, as Hydra overrides ready to paste after
``mpirun -n <stages> python -m pipespec_mpi``.

A plan config (YAML or JSON):

  hierarchy: tiny                  # optional: conf/hierarchy/<name>.yaml, for the overrides
  target: tiny-target-4L           # the model whose output is wanted (default: the slowest)
  latency_ms: 0.5                  # per-message latency between stages (default 0)
  blocking_reads: false            # header reads wait for a computing stage (MPI RMA, MPICH)
  models:                          # forward time in ms by number of tokens; loop overhead
    tiny-draft-1L: {forward_ms: {1: 0.9, 16: 1.2}, overhead_ms: 0.1}
    tiny-mid-3L: {forward_ms: {1: 2.0, 16: 2.8}}
    tiny-target-4L: {forward_ms: {1: 2.2, 16: 3.0}}
  acceptance:                      # i.i.d. rate per (drafter -> verifier) pair
    tiny-draft-1L -> tiny-mid-3L: 0.66
    tiny-mid-3L -> tiny-target-4L: 0.82
    tiny-draft-1L -> tiny-target-4L: 0.60

A hierarchy needs a rate for each adjacent pair; with ``--transitive`` a missing a -> c is
estimated as rate(a -> b) * rate(b -> c) through a known b (a lower bound under the simulator's
token model), otherwise the hierarchy is skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pipespec_mpi import simulate as sim
from pipespec_mpi.config import CONF_DIR, METHODS, DecodeConfig, StageConfig, compose_config
from pipespec_mpi.records import Record
from pipespec_mpi.simulate.fit import fit_run, load_records
from pipespec_mpi.simulate.paper import PAPER_LATENCY_S, PAPER_PROFILES, PAPER_RATES, PaperSetting, paper_ms


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


@dataclass(frozen=True)
class Candidate:
    method: str
    models: tuple[str, ...]
    lookahead: int
    ms_per_token: float
    speedup: float = float("nan")
    policy: str = "static"  # PipeSpec's decode.policy (adaptive: the lookahead is unused)


# ---------------------------------------------------------------------------------- inputs
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
    any, else SD, else AR)."""
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
        source=f"{run_dir} ({method} records)",
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


# ---------------------------------------------------------------------------------- search
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


def evaluate(
    inp: PlanInputs,
    max_stages: int = 3,
    lookaheads: Sequence[int] = (0, 1, 2, 4, 8),
    sd_windows: Sequence[int] = (1, 2, 3, 4, 6, 8),
    n_tokens: int = 128,
    seeds: Sequence[int] = (0, 1, 2),
    max_run_ahead: int = DecodeConfig.max_run_ahead,
    max_verify: int = DecodeConfig.max_verify,
    transitive: bool = False,
) -> list[Candidate]:
    """Every candidate, with its predicted ms/token and speedup over AR of the target."""
    decode = DecodeConfig(
        max_new_tokens=n_tokens, max_run_ahead=max_run_ahead, max_verify=max_verify, policy="static"
    )
    base = sim.SimConfig(
        decode=decode,
        latency_s=inp.latency_s,
        up_latency_s=inp.up_latency_s,
        blocking_reads=inp.blocking_reads,
        include_prefill=False,
    )
    paper = inp.paper and replace(
        inp.paper, n_tokens=n_tokens, seeds=tuple(seeds), max_run_ahead=max_run_ahead, max_verify=max_verify,
        blocking_reads=inp.blocking_reads,
    )  # fmt: skip

    def ms_of(
        method: str, models: tuple[str, ...], rates: tuple[float, ...], window: int, policy: str
    ) -> float:
        if paper:
            return paper_ms(method, models, window, policy, paper)
        key = {"sd": {"sd_window": window}, "pipespec": {"lookahead": window}}.get(method, {})
        cfg = replace(base, method=method, decode=replace(decode, policy=policy, **key))
        return sim.mean_ms_per_token(
            [inp.models[m] for m in models], rates, cfg, seeds[:1] if method == "ar" else seeds
        )

    ar_ms = ms_of("ar", (inp.target,), (), 0, "static")
    cands = [Candidate("ar", (inp.target,), 0, ar_ms, 1.0)]
    for models, rates in hierarchies(inp, max_stages, transitive):
        if len(models) < 2:
            continue
        for method, looks in (("sd", sd_windows), ("pipespec", lookaheads)):
            for la in looks:
                if la > max_verify or la > max_run_ahead:
                    continue
                ms = ms_of(method, models, rates, la, "static")
                cands.append(Candidate(method, models, la, ms, ar_ms / ms))
        ms = ms_of("pipespec", models, rates, 0, "adaptive")
        cands.append(Candidate("pipespec", models, 0, ms, ar_ms / ms, policy="adaptive"))
    return cands


def best(cands: Sequence[Candidate], top: int = 3) -> dict[str, list[Candidate]]:
    out: dict[str, list[Candidate]] = {}
    for m in METHODS:
        cs = sorted((c for c in cands if c.method == m), key=lambda c: c.ms_per_token)
        out[m] = cs[:top]
    return out


# ---------------------------------------------------------------------------------- output
def _hydra_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    return str(v)


def _stage_override(st: StageConfig) -> str:
    """A stage as a Hydra dict: its name, kind and what differs from StageConfig's defaults."""
    default = StageConfig(st.name, st.kind)
    fields = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
    keep = {k: v for k, v in fields.items() if k in ("name", "kind") or v != getattr(default, k)}
    return "{" + ", ".join(f"{k}: {_hydra_value(v)}" for k, v in keep.items()) + "}"


def matching_hierarchy(stage_names: Sequence[str]) -> str | None:
    """A conf/hierarchy preset whose stages are exactly these, in this order."""
    for name in hierarchy_presets():
        defs = stage_defs_of(name)
        if defs is not None and list(defs) == list(stage_names):
            return name
    return None


def overrides(c: Candidate, inp: PlanInputs) -> str:
    """Hydra overrides reproducing a candidate: a hierarchy preset with exactly its stages if
    there is one, else the configured hierarchy with its stage list replaced. The window is set
    where each method reads it: ``decode.sd_window`` for SD, ``decode.lookahead`` for PipeSpec."""
    parts = [f"method={c.method}"]
    if c.method == "sd":
        parts.append(f"decode.sd_window={c.lookahead}")
    elif c.policy == "adaptive":
        parts.append("decode.policy=adaptive")
    elif c.method == "pipespec":
        parts.append(f"decode.lookahead={c.lookahead}")
    defs = inp.stage_defs
    if defs and all(m in defs for m in c.models):
        preset = matching_hierarchy([defs[m].name for m in c.models])
        if preset:
            return " ".join([f"hierarchy={preset}", *parts])
    if inp.hierarchy in hierarchy_presets():  # not a plan's own, such as auto[prompt-lookup+...]
        parts.insert(0, f"hierarchy={inp.hierarchy}")
    if defs and all(m in defs for m in c.models) and list(c.models) != list(defs):
        idx = {m: i for i, m in enumerate(c.models)}
        orig = list(defs)
        stages = []
        for m in c.models:
            st = defs[m]
            if st.copy_of is not None:
                ref = orig[st.copy_of] if st.copy_of < len(orig) else None
                if ref not in idx:
                    return " ".join(parts) + f"  # {m} copies {ref}, which is not in this hierarchy"
                st = replace(st, copy_of=idx[ref])
            stages.append(_stage_override(st))
        parts.append("'hierarchy.stages=[" + ", ".join(stages) + "]'")
    return " ".join(parts)


def table(picked: Mapping[str, Sequence[Candidate]], inp: PlanInputs) -> str:
    lines = [
        f"inputs: {inp.source}; target {inp.target}; latency {1000 * inp.latency_s:.2f} ms; "
        f"blocking header reads: {'yes' if inp.blocking_reads else 'no'}",
        f"{'method':<9} {'hierarchy':<40} {'la':>3} {'ms/token':>9} {'speedup':>8}",
    ]
    for m, cs in picked.items():
        for c in cs:
            la = "-" if m == "ar" else "ad" if c.policy == "adaptive" else str(c.lookahead)
            lines.append(
                f"{m:<9} {' -> '.join(c.models):<40} {la:>3} {c.ms_per_token:>9.2f} {c.speedup:>7.2f}x"
            )
            lines.append(f"    mpirun -n {len(c.models)} python -m pipespec_mpi {overrides(c, inp)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pipespec-plan", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--config", help="a plan config (YAML or JSON)")
    src.add_argument("--from", dest="run_dir", help="a run directory: use its measured profiles")
    src.add_argument("--preset", choices=["paper"], help="the paper's models (the default)")
    src.add_argument(
        "--measure",
        action="store_true",
        help="measure the candidate stages on this machine and choose, as hierarchy=auto does "
        "(Hydra overrides after the options; default hierarchy=auto)",
    )
    ap.add_argument("--force", action="store_true", help="with --measure: ignore the cache")
    ap.add_argument("--ranks", type=int, default=3, help="with --measure: the job's world size")
    ap.add_argument("overrides", nargs="*", help="with --measure: Hydra overrides")
    ap.add_argument("--max-stages", type=int, default=3)
    ap.add_argument("--lookaheads", default="0,1,2,4,8", help="PipeSpec lookaheads to try")
    ap.add_argument("--sd-windows", default="1,2,3,4,6,8", help="SD windows to try")
    ap.add_argument("--tokens", type=int, default=None,
                    help="tokens per simulated prompt (default 128; the paper: its traces')")  # fmt: skip
    ap.add_argument(
        "--seeds", type=int, default=None, help="simulations per candidate (default 3; the paper: 8)"
    )
    ap.add_argument("--max-run-ahead", type=int, default=None,
                    help="default: decode.max_run_ahead's; the paper: 64 (uncapped)")  # fmt: skip
    ap.add_argument("--max-verify", type=int, default=None,
                    help="default: decode.max_verify's; the paper: 64")  # fmt: skip
    ap.add_argument("--transitive", action="store_true", help="estimate missing pair rates")
    ap.add_argument(
        "--blocking-reads",
        choices=["yes", "no"],
        default=None,
        help="header reads wait for a computing stage, as with run.epochs_window=rma (default: no)",
    )
    ap.add_argument(
        "--top",
        type=int,
        default=None,
        help="configurations per method (default 3; --measure: rows, default 8)",
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.overrides and not a.measure:
        ap.error(f"overrides {a.overrides} are for --measure")
    if a.measure:
        return measure_main(a.overrides, a.ranks, a.force, a.top or 8)
    try:
        if a.config:
            inp = load_plan_config(a.config)
        elif a.run_dir:
            inp = inputs_from_run(a.run_dir)
        else:
            inp = paper_inputs()
        if a.blocking_reads is not None:
            inp = replace(inp, blocking_reads=a.blocking_reads == "yes")
        cands = evaluate(
            inp,
            max_stages=a.max_stages,
            lookaheads=[int(x) for x in a.lookaheads.split(",") if x.strip()],
            sd_windows=[int(x) for x in a.sd_windows.split(",") if x.strip()],
            n_tokens=a.tokens or (inp.paper.n_tokens if inp.paper else 128),
            seeds=tuple(range(a.seeds or (len(inp.paper.seeds) if inp.paper else 3))),
            max_run_ahead=a.max_run_ahead
            or (inp.paper.max_run_ahead if inp.paper else DecodeConfig.max_run_ahead),
            max_verify=a.max_verify or (inp.paper.max_verify if inp.paper else DecodeConfig.max_verify),
            transitive=a.transitive,
        )
    except (OSError, ValueError, KeyError) as err:
        print(f"pipespec_mpi.plan: {err}", file=sys.stderr)
        return 2
    picked = best(cands, a.top or 3)
    if a.json:
        rows = [
            {
                "method": c.method,
                "models": list(c.models),
                "lookahead": c.lookahead,
                "policy": c.policy,
                "ms_per_token": c.ms_per_token,
                "speedup": c.speedup,
                "overrides": overrides(c, inp),
            }
            for cs in picked.values()
            for c in cs
        ]
        print(json.dumps(rows, indent=2))
    else:
        print(table(picked, inp))
    return 0


def measure_main(overrides: Sequence[str], ranks: int, force: bool, top: int = 8) -> int:
    """``--measure``: what ``mpirun -n RANKS python -m pipespec_mpi OVERRIDES`` with
    ``hierarchy=auto`` would measure and choose here, printed, with the command that runs it."""
    from pipespec_mpi.auto.calibrate import Node, calibrate, calibration_prompts
    from pipespec_mpi.auto.choose import table as plan_table
    from pipespec_mpi.errors import UserError
    from pipespec_mpi.models.loader import load_tokenizer

    overrides = list(overrides)
    if not any(o.startswith("hierarchy=") for o in overrides):
        overrides.insert(0, "hierarchy=auto")
    if force:
        overrides.append("auto.force=true")
    try:
        cfg = compose_config(overrides)
        if not cfg.hierarchy.choose:
            overrides.append("hierarchy.choose=true")
            cfg = compose_config(overrides)
        node = Node.here(cfg.auto.replicas, ranks, ranks_on_node=ranks, bound=False)
        tok = load_tokenizer(cfg.hierarchy.tokenizer, cfg.hierarchy.name)
        cal = calibrate(cfg, calibration_prompts(cfg, tok), tok.eos_token_id, node)
    except (UserError, ValueError, OSError) as err:
        print(f"pipespec_mpi.plan: {err}", file=sys.stderr)
        return 2
    got = "from the cache: " + ", ".join(cal.cached) if cal.cached else "measured"
    if cal.spot:
        spot = cal.spot.to_json()
        got += f" (target step {spot['measured_ms']} ms now, {spot['cached_ms']} cached: {spot['verdict']})"
    if cal.phases:
        got += " (" + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in cal.phases.items()) + ")"
    print(f"candidates: {cfg.hierarchy.name} ({', '.join(s.name for s in cfg.hierarchy.stages)}); "
          f"{node.cores} cores, {ranks} ranks; {got} in {cal.seconds:.1f} s")  # fmt: skip
    print(plan_table(cal.plan, top))
    print(
        f"    mpirun -n {ranks} python -m pipespec_mpi {' '.join(o for o in overrides if 'force' not in o)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
