"""What runs an option: the config (``realize``, for ``hierarchy=auto``'s job) or the Hydra
overrides after ``mpirun -n <stages> python -m pipespec_mpi`` (``overrides``, printed by
``pipespec-plan``). Both take the option's stages with ``select_stages``, the one place a copy's
``copy_of`` is re-pointed to its source's index in the smaller pipeline."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import replace

from pipespec_mpi.config import DRAFTER_KINDS, AppConfig, HierarchyConfig, StageConfig
from pipespec_mpi.config.schema import Policy
from pipespec_mpi.plan.options import Option, Plan
from pipespec_mpi.plan.sources import PlanInputs, hierarchy_presets, stage_defs_of
from pipespec_mpi.run.jobs import job_methods
from pipespec_mpi.topology import route_name


def select_stages(stages: Sequence[StageConfig], names: Sequence[str]) -> list[StageConfig]:
    """The stages called ``names``, in that order, each copy's ``copy_of`` re-pointed to where its
    source now is; ValueError when a copy's source is not among them."""
    by_name = {s.name: i for i, s in enumerate(stages)}
    index = [by_name[n] for n in names]
    out = []
    for i in index:
        st = stages[i]
        if st.copy_of is not None:
            if st.copy_of not in index:
                ref = stages[st.copy_of].name if st.copy_of < len(stages) else st.copy_of
                raise ValueError(f"{st.name} copies {ref}, which is not in this pipeline")
            st = replace(st, copy_of=index.index(st.copy_of))
        out.append(st)
    return out


def is_route(route: Sequence[str], pipeline: Sequence[str]) -> bool:
    """``route`` is a sub-pipeline of ``pipeline`` ending with its last stage (in its order)."""
    rest = iter(pipeline)
    return bool(route) and route[-1] == pipeline[-1] and all(name in rest for name in route)


def online_pipeline(plan: Plan) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """For ``method=online``: the longest pipeline planned whose routes hold the fastest predicted
    option (AR's included: every pipeline has it), and its routes of more than one stage, the
    fastest predicted first (the order the online plan measures them in)."""
    batch1 = [o for o in plan.options if o.batch_size == 1]
    longest = max(len(o.pipeline) for o in batch1)
    pipelines = dict.fromkeys(o.pipeline for o in batch1 if len(o.pipeline) == longest)

    spec = [o for o in batch1 if o.method != "ar"]

    def fastest(options: list[Option], p: tuple[str, ...]) -> float:
        return min((o.ms_per_token for o in options if is_route(o.pipeline, p)), default=float("inf"))

    # the fastest option on its routes, then the fastest speculative one
    pipeline = min(pipelines, key=lambda p: (fastest(batch1, p), fastest(spec, p)))
    ranked = sorted(spec, key=lambda o: o.ms_per_token)
    routes = dict.fromkeys(o.pipeline for o in ranked if is_route(o.pipeline, pipeline))
    return pipeline, list(routes)


def realize(cfg: AppConfig, plan: Plan, bound: bool) -> AppConfig:
    """The config that runs the plan: its stages (copies re-pointed, threads set unless the
    launcher binds ranks), its method and window. In ``run.mode=benchmark`` the hierarchy is the
    best speculative option's, so that every method of the comparison can run on it. Where the
    job's method is online (run/online.py), the pipeline is ``online_pipeline``'s and its routes,
    in predicted order, are the online plan's (every rank's threads chosen route by route)."""
    opt = plan.chosen
    if cfg.run.mode == "benchmark" and plan.best_speculative is not None:
        opt = plan.best_speculative
    online = "online" in job_methods(cfg) and plan.best_speculative is not None
    pipeline = opt.pipeline
    if online:
        opt = plan.best_speculative
        pipeline, routes = online_pipeline(plan)
        kinds = {st.name: st.kind for st in cfg.hierarchy.stages}
        if kinds[pipeline[0]] in DRAFTER_KINDS:  # kept, as run/online.py ``arms`` keeps it by default
            routes = [r for r in routes if r[0] == pipeline[0]]
        index = {name: i for i, name in enumerate(pipeline)}
        cfg = replace(cfg, online=replace(cfg.online, routes=tuple(
            route_name(tuple(index[n] for n in r)) for r in routes)))  # fmt: skip
    h = cfg.hierarchy
    chosen = select_stages(h.stages, pipeline)
    threads = (
        None if bound or online else plan.threads.get(sum(st.kind not in DRAFTER_KINDS for st in chosen))
    )
    stages = [
        replace(st, threads=st.threads or (None if st.kind in DRAFTER_KINDS else threads)) for st in chosen
    ]
    hier = HierarchyConfig(
        name=f"{h.name}[{'+'.join(pipeline)}]", stages=tuple(stages), tokenizer=h.tokenizer,
        tiny=h.tiny, choose=False,
    )  # fmt: skip
    decode = replace(opt.setting, batch_size=1).decode(cfg.decode)
    method = plan.chosen.method if cfg.run.mode == "single" and not online else cfg.method
    if cfg.run.mode == "single" and not online:
        decode = replace(decode, batch_size=plan.chosen.batch_size)
    run = cfg.run
    if len(stages) == 1:  # the target alone: nothing but AR can run on it
        run = replace(run, methods=("ar",))
    return replace(cfg, hierarchy=hier, decode=decode, method=method, run=run)


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


def overrides(o: Option, inp: PlanInputs) -> str:
    """Hydra overrides reproducing an option: a hierarchy preset with exactly its stages if
    there is one, else the configured hierarchy with its stage list replaced. The window is set
    where each method reads it: ``decode.sd_window`` for SD, ``decode.lookahead`` for PipeSpec."""
    parts = [f"method={o.method}"]
    if o.method == "sd":
        parts.append(f"decode.sd_window={o.window}")
    elif Policy(o.policy).learns:
        parts.append(f"decode.policy={o.policy}")
    elif o.method == "pipespec":
        parts.append(f"decode.lookahead={o.window}")
    if o.method == "pipespec" and o.run_ahead:
        parts.append(f"decode.max_run_ahead={o.run_ahead}")
    defs = inp.stage_defs
    known = bool(defs) and all(m in defs for m in o.pipeline)
    if known:
        preset = matching_hierarchy([defs[m].name for m in o.pipeline])
        if preset:
            return " ".join([f"hierarchy={preset}", *parts])
    if inp.hierarchy in hierarchy_presets():  # not a plan's own, such as auto[prompt-lookup+...]
        parts.insert(0, f"hierarchy={inp.hierarchy}")
    if known and list(o.pipeline) != list(defs):
        # the plan's model names are the stage names of its hierarchy (stage_defs' keys)
        stages = [replace(s, name=n) for n, s in defs.items()]
        try:
            chosen = select_stages(stages, o.pipeline)
        except ValueError as err:
            return " ".join(parts) + f"  # {err}"
        chosen = [replace(st, name=defs[n].name) for st, n in zip(chosen, o.pipeline)]
        parts.append("'hierarchy.stages=[" + ", ".join(_stage_override(st) for st in chosen) + "]'")
    return " ".join(parts)
