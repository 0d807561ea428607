"""The Hydra schema registered, a composed tree loaded into the dataclasses, and ``validate``:
the rules across fields and the allowed values, one ``ConfigError`` naming every offending value."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from pipespec_mpi.choices import problems as choice_problems
from pipespec_mpi.config.schema import (
    CONF_DIR,
    DRAFTER_KINDS,
    AppConfig,
    ConfigError,
    DecodeConfig,
)
from pipespec_mpi.config.shapes import SHAPES
from pipespec_mpi.data.config import problems as dataset_problems
from pipespec_mpi.topology import parse_route, route_name, routes


def register() -> None:
    """Store ``AppConfig`` in Hydra's ConfigStore as ``app_schema`` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="app_schema", node=AppConfig)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def unknown_keys(tree: object, cls: type, where: str = "") -> list[str]:
    """Keys of a plain config tree that ``cls`` has no field for (Hydra's ``+key=value`` adds a
    key even to a schema node, and building the dataclass would silently drop it)."""
    if not isinstance(tree, dict):
        return []
    hints = typing.get_type_hints(cls)
    out = []
    for key, value in tree.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in hints:
            known = ", ".join(f.name for f in dataclasses.fields(cls))
            out.append(f"{path}: unknown key (known: {known})")
            continue
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            out += unknown_keys(value, hint, path)
        elif typing.get_origin(hint) is tuple and dataclasses.is_dataclass(typing.get_args(hint)[0]):
            for i, item in enumerate(value or []):
                out += unknown_keys(item, typing.get_args(hint)[0], f"{path}[{i}]")
    return out


def load_config(cfg) -> AppConfig:
    """The composed Hydra tree (a DictConfig on ``app_schema``) as typed, validated config."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    problems = unknown_keys(OmegaConf.to_container(cfg, resolve=False), AppConfig)
    if problems:
        raise ConfigError(problems)
    try:
        app = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:  # a required value left unset (``???``)
        raise ConfigError([str(err).splitlines()[0] + f" ({err.full_key})"]) from None
    problems = validate(app)
    if problems:
        raise ConfigError(problems)
    return app


RUN_CONFIG = Path(".hydra") / "config.yaml"  # in a run directory, written by rank 0


def load_run_config(run_dir: str | Path) -> AppConfig:
    """The typed config a run directory was made with (its ``.hydra/config.yaml`` on the schema,
    validated): the one reader of it. FileNotFoundError where the run has none; ConfigError where
    it no longer loads (a key only an older version had)."""
    from omegaconf import OmegaConf

    path = Path(run_dir) / RUN_CONFIG
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: missing (not a pipespec_mpi run directory, or its rank 0 never started)"
        )
    return load_config(OmegaConf.merge(OmegaConf.structured(AppConfig), OmegaConf.load(path)))


def compose_config(overrides: Sequence[str] = ()) -> AppConfig:
    """What ``python -m pipespec_mpi OVERRIDES`` runs with (Hydra's compose API, conf/)."""
    from hydra import compose, initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return load_config(compose(config_name="config", overrides=list(overrides)))


def override_key(override: str) -> str:
    """The dotted key a Hydra override sets (``decode.lookahead=2`` -> ``decode.lookahead``;
    ``+x=1``, ``~x`` and ``++x=1`` name ``x``)."""
    return override.split("=", 1)[0].lstrip("+~")


def split_tool_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """A tool's positional arguments as (paths, Hydra overrides): an override has an ``=``."""
    return [x for x in args if "=" not in x], [x for x in args if "=" in x]


def compose_tool_config(overrides: Sequence[str], keys: Sequence[str]) -> tuple[AppConfig, set[str]]:
    """A tool's settings, spelled as the app's keys: ``compose_config(overrides)`` (so a value is
    checked as a job would check it) and the keys the overrides set. Each override must be one of
    ``keys`` or under one (``decode`` allows every ``decode.*``); one ConfigError names every
    other, since a tool that ignored a key would print a prediction for something else."""
    given = {override_key(o) for o in overrides}
    bad = sorted(k for k in given if not any(k == a or k.startswith(a + ".") for a in keys))
    if bad:
        raise ConfigError([f"{k}: not a setting of this tool (it reads {', '.join(keys)})" for k in bad])
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose_config(overrides), given
    except (HydraException, OmegaConfBaseException) as err:  # an unknown key, a value of the wrong type
        cause = err.__cause__ or err
        raise ConfigError([str(cause).splitlines()[0] + f" ({' '.join(overrides)})"]) from err


def validate(cfg: AppConfig) -> list[str]:
    """Every problem with a typed config, as messages naming the key and value: the enumerated
    settings outside their choices (Hydra refuses those while composing; this catches a config
    built in Python), then the rules of each node and across nodes."""
    p = choice_problems(replace(cfg, decode=DecodeConfig()))  # the decode node: validate_decode
    h = cfg.hierarchy
    if not h.stages:
        p.append("hierarchy.stages: at least one stage is required")
    for i, s in enumerate(h.stages):
        where = f"hierarchy.stages[{i}] ({s.name})"
        if s.kind in ("hf", "gguf") and not s.model:
            p.append(f"{where}.model: required for kind={s.kind} (a hub id or a local path)")
        if s.kind == "gguf" and not s.gguf_file:
            p.append(f"{where}.gguf_file: required for kind=gguf")
        if s.kind in DRAFTER_KINDS and i != 0 and not h.choose:  # (candidates: any may head a pipeline)
            p.append(f"{where}: {s.kind} has no model to verify with; it can only be stage 0")
        if s.kind == "prompt_lookup" and (s.ngram < 1 or s.max_proposal < 1):
            p.append(f"{where}: ngram={s.ngram} and max_proposal={s.max_proposal} must be >= 1")
        if s.kind == "suffix":
            if s.max_proposal < 1 or s.max_match < 1 or s.store_tokens < 0:
                p.append(f"{where}: max_proposal={s.max_proposal}, max_match={s.max_match} must be "
                         f">= 1 and store_tokens={s.store_tokens} >= 0")  # fmt: skip
            if not 0.0 <= s.min_survival < 1.0:
                p.append(f"{where}.min_survival={s.min_survival}: must be in [0, 1)")
            if s.corpus is not None and not Path(s.corpus).is_file():
                p.append(f"{where}.corpus={s.corpus!r}: no such file")
        if s.dense_rows is not None and s.dense_rows < 0:
            p.append(f"{where}.dense_rows={s.dense_rows}: must be >= 0 (0: never), or null (by CPU)")
        if s.kind in ("int8_copy", "lowbit_copy") and (
            s.copy_of is None or not 0 <= s.copy_of < len(h.stages) or s.copy_of == i
        ):
            p.append(f"{where}.copy_of={s.copy_of}: must name another stage's index")
        if s.kind == "tiny" and s.layers is not None and not 1 <= s.layers <= h.tiny.num_layers:
            p.append(f"{where}.layers={s.layers}: must be in 1..{h.tiny.num_layers}")
        if s.kind == "random" and s.shape not in SHAPES:
            p.append(f"{where}.shape={s.shape!r}: required for kind=random, one of {', '.join(SHAPES)}")
        if s.noise < 0:
            p.append(f"{where}.noise={s.noise}: must be >= 0")
        if s.n_gpus < 1:
            p.append(f"{where}.n_gpus={s.n_gpus}: must be >= 1")
        if s.quantization == "int4":
            if s.kind not in ("hf", "gguf", "smollm2", "random"):
                p.append(f"{where}.quantization=int4: for a checkpoint's model (kind hf, gguf, smollm2, "
                         f"random), not kind={s.kind}")  # fmt: skip
            if s.int4_group not in (32, 64, 128, 256):
                p.append(f"{where}.int4_group={s.int4_group}: one of 32, 64, 128, 256")
        if s.threads is not None and s.threads < 1:
            p.append(f"{where}.threads={s.threads}: must be >= 1")
    if h.stages and h.stages[-1].kind in DRAFTER_KINDS:
        p.append("hierarchy: the last stage must be a model (it produces the answer)")

    methods = set(cfg.run.methods) if cfg.run.mode == "benchmark" else {cfg.method}
    sd_needed = "sd" in methods or ("online" in methods and "sd" in cfg.online.methods)
    p.extend(validate_decode(cfg.decode, sd_needed))

    p.extend(dataset_problems(cfg.dataset))

    t = cfg.transport
    if t.depth < 1 or t.max_msg_tokens < 1:
        p.append(f"transport.depth={t.depth}, max_msg_tokens={t.max_msg_tokens}: must be >= 1")
    if t.rendezvous_timeout_s <= 0:
        p.append(f"transport.rendezvous_timeout_s={t.rendezvous_timeout_s}: must be > 0")
    if t.op_timeout_s <= 0:
        p.append(f"transport.op_timeout_s={t.op_timeout_s}: must be > 0")
    if t.port is not None and not (isinstance(t.port, int) and 1 <= t.port <= 65535):
        p.append(f"transport.port={t.port}: must be a TCP port, 1..65535 (or null: a free one)")

    s = cfg.sampling
    if s.temperature < 0:
        p.append(f"sampling.temperature={s.temperature}: must be >= 0 (0 = greedy)")
    if s.top_k < 0:
        p.append(f"sampling.top_k={s.top_k}: must be >= 0 (0 = off)")
    if not 0 < s.top_p <= 1:
        p.append(f"sampling.top_p={s.top_p}: must be in (0, 1]")
    if not _int(s.num_samples) or s.num_samples < 1:
        p.append(f"sampling.num_samples={s.num_samples}: must be an integer >= 1")

    r = cfg.run
    for key in ("stall_timeout_s", "startup_timeout_s", "progress_every_s"):
        if getattr(r, key) <= 0:
            p.append(f"run.{key}={getattr(r, key)}: must be > 0")
    if any(not _int(b) or not 1 <= b <= 64 for b in r.batch_sizes):
        p.append(f"run.batch_sizes={list(r.batch_sizes)}: integers in 1..64")
    if r.batch_sizes and r.mode != "benchmark":
        p.append(
            f"run.batch_sizes={list(r.batch_sizes)}: a sweep of run.mode=benchmark; use decode.batch_size"
        )

    a = cfg.auto
    if not _int(a.replicas) or a.replicas < 1:
        p.append(f"auto.replicas={a.replicas}: must be an integer >= 1")
    if not _int(a.calibration_prompts) or a.calibration_prompts < 1:
        p.append(f"auto.calibration_prompts={a.calibration_prompts}: must be an integer >= 1")
    if not _int(a.calibration_tokens) or a.calibration_tokens < 8:
        p.append(f"auto.calibration_tokens={a.calibration_tokens}: must be an integer >= 8")
    if not a.token_counts or any(not _int(n) or n < 1 for n in a.token_counts) or 1 not in a.token_counts:
        p.append(f"auto.token_counts={list(a.token_counts)}: positive integers, 1 among them")
    if not _int(a.repeats) or a.repeats < 1:
        p.append(f"auto.repeats={a.repeats}: must be an integer >= 1")
    if a.margin < 0:
        p.append(f"auto.margin={a.margin}: must be >= 0")
    for name in ("stale_factor", "off_factor"):
        if not getattr(a, name) > 1:
            p.append(f"auto.{name}={getattr(a, name)}: must be > 1 (a factor, either way)")
    if not _int(a.max_stages) or a.max_stages < 1:
        p.append(f"auto.max_stages={a.max_stages}: must be an integer >= 1")
    if not a.batch_sizes or any(not _int(b) or not 1 <= b <= 64 for b in a.batch_sizes):
        p.append(f"auto.batch_sizes={list(a.batch_sizes)}: integers in 1..64, at least one")
    p.extend(online_problems(cfg))
    return p


def online_problems(cfg: AppConfig) -> list[str]:
    """``online``'s settings, and its routes against the hierarchy."""
    o, h = cfg.online, cfg.hierarchy
    p: list[str] = []
    valid = routes(h.n_stages, h.model_free)
    for text in o.routes:
        try:
            route = parse_route(text)
        except ValueError:
            route = ()
        if route not in valid:
            p.append(f"online.routes: {text!r} is not a route of {h.name} (stage indices joined by '-', "
                     f"ending with {h.n_stages - 1}, a model-free stage only first): one of "
                     f"{', '.join(route_name(r) for r in valid)}")  # fmt: skip
    if any(m in ("ar", "online") for m in o.methods) or not o.methods:
        p.append(f"online.methods={list(o.methods)}: speculative methods (sd, pipespec), at least one")
    for key in ("explore", "recheck_every", "window", "chunk"):
        if not _int(getattr(o, key)) or getattr(o, key) < 1:
            p.append(f"online.{key}={getattr(o, key)}: must be an integer >= 1")
    if not 0 <= o.margin < 1:
        p.append(f"online.margin={o.margin}: must be in 0..1")
    return p


def validate_decode(d: DecodeConfig, sd_needed: bool) -> list[str]:
    """The stage loop's settings: every problem, naming the keys and values."""
    p: list[str] = choice_problems(d, "decode")
    if not _int(d.lookahead) or not 0 <= d.lookahead <= 64:
        p.append(f"decode.lookahead={d.lookahead}: must be an integer in 0..64")
    if not _int(d.max_new_tokens) or not 1 <= d.max_new_tokens <= 32768:
        p.append(f"decode.max_new_tokens={d.max_new_tokens}: must be an integer in 1..32768")
    if not _int(d.max_verify) or d.max_verify < 1:
        p.append(f"decode.max_verify={d.max_verify}: must be >= 1")
    if d.sd_window is not None and (not _int(d.sd_window) or not 1 <= d.sd_window <= 64):
        p.append(f"decode.sd_window={d.sd_window}: must be null (= decode.lookahead) or an integer in 1..64")
    windows = [w for w in (d.lookahead, d.sd_window) if _int(w)]
    if _int(d.max_verify) and windows and d.max_verify < max(windows):
        p.append(f"decode.max_verify={d.max_verify}: must be >= decode.lookahead={d.lookahead} "
                 f"and decode.sd_window={d.sd_window}")  # fmt: skip
    if not _int(d.max_run_ahead) or d.max_run_ahead < max([1, *windows]):
        p.append(f"decode.max_run_ahead={d.max_run_ahead}: must be >= max(1, decode.lookahead="
                 f"{d.lookahead}, decode.sd_window={d.sd_window})")  # fmt: skip
    if d.batch_verify_rows is not None and (not _int(d.batch_verify_rows) or d.batch_verify_rows < 2):
        p.append(f"decode.batch_verify_rows={d.batch_verify_rows}: must be null or an integer >= 2")
    for key in ("draft_survival", "accept_prior"):
        v = getattr(d, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            p.append(f"decode.{key}={v!r}: must be a number in 0..1")
    v = d.estimate_rate
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v <= 1.0:
        p.append(f"decode.estimate_rate={v!r}: must be a number in (0, 1]")
    if not _int(d.batch_size) or not 1 <= d.batch_size <= 64:
        p.append(f"decode.batch_size={d.batch_size}: must be an integer in 1..64")
    if sd_needed and d.sd_window is None and d.lookahead == 0:
        p.append(
            "decode.lookahead=0 with sd (method=sd or in run.mode=benchmark) and decode.sd_window=null: "
            "synchronous SD verifies a fixed window: set decode.sd_window or decode.lookahead >= 1"
        )
    return p
