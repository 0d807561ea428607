"""Build one stage's model (and the hierarchy's tokenizer) from typed config.

Sources: ``tiny`` (derived random models), ``random`` (a named shape, random weights), ``hf``
(hub id or local directory, safetensors), ``gguf``, ``smollm2`` (embedded), ``int8_copy``
(dynamic int8 copy of another stage), ``lowbit_copy`` (weight-only bf16/int8/q8/q4 copy of
another stage) and ``prompt_lookup`` (model-free). Hub access is off unless
``PIPESPEC_ALLOW_DOWNLOAD=1``: a model that is not on disk fails at once with a message naming
the stage, the id and the fix.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch

from pipespec_mpi.config import DRAFTER_KINDS, HierarchyConfig, StageConfig, TokenizerConfig
from pipespec_mpi.config.schema import Kernels
from pipespec_mpi.models.engine import Weights, unsupported_reason
from pipespec_mpi.models.prompt_lookup import PromptLookup
from pipespec_mpi.models.scorer import Engine, EngineScorer
from pipespec_mpi.models.shapes import random_llama
from pipespec_mpi.models.smollm2 import ModelUnavailable, ensure_cache
from pipespec_mpi.models.split import spread
from pipespec_mpi.models.suffix import SuffixDrafter, read_corpus
from pipespec_mpi.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from pipespec_mpi.stage.ports import Proposer, Scorer

log = logging.getLogger("pipespec_mpi")

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def allow_download() -> bool:
    return os.environ.get("PIPESPEC_ALLOW_DOWNLOAD", "0") == "1"


def _unavailable(stage: str, ident: str, err: Exception) -> ModelUnavailable:
    return ModelUnavailable(
        f"stage {stage!r}: model {ident!r} is not available offline ({type(err).__name__}: "
        f"{str(err).splitlines()[0][:200]}). Provide the weights first: download them where the "
        f"network is reachable (`huggingface-cli download {ident}`) into $HF_HOME (now "
        f"{os.environ.get('HF_HOME', '~/.cache/huggingface')}), or set the stage's model to a "
        "local directory with config.json and *.safetensors; PIPESPEC_ALLOW_DOWNLOAD=1 lets "
        "this job fetch from the hub itself."
    )


def stage_device(hier: HierarchyConfig, stage: int, devices: Sequence[int]) -> str:
    """Where a stage's model computes: its ``device`` setting, else its rank's first GPU
    (``devices``), else the CPU; a CPU copy of a target (int8_copy, lowbit_copy) on the CPU, a
    model-free drafter on the host."""
    s = hier.stages[stage]
    if stage in hier.model_free:
        return "host"
    if s.kind in ("int8_copy", "lowbit_copy"):
        return "cpu"
    if s.device != "auto":
        return s.device
    return f"cuda:{devices[0]}" if devices else "cpu"


def engine_kernels(asked: str, device: str) -> Literal["cpu", "portable"]:
    """The engine's plug-ins for ``device.kernels`` (or the seam's choice, "cpu" or "portable"):
    the project's kernels on a CPU (models/cpu/) unless portable is asked, torch's linears and
    SDPA elsewhere."""
    return "cpu" if asked in (Kernels.auto, "cpu") and device == "cpu" else "portable"


def _from_pretrained(stage: StageConfig, device: torch.device, cuda_devices: list[int], **extra):
    from transformers import AutoModelForCausalLM

    kwargs = dict(
        dtype=DTYPES[stage.dtype],
        trust_remote_code=stage.trust_remote_code,
        local_files_only=not allow_download(),
        **extra,
    )
    if stage.quantization in ("bnb_4bit", "bnb_8bit"):
        from transformers import BitsAndBytesConfig

        if stage.quantization == "bnb_4bit":
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=DTYPES[stage.dtype],
            )
        else:
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    if len(cuda_devices) > 1:  # bitsandbytes over several GPUs: accelerate's split (transformers' forward)
        kwargs["device_map"] = "auto"
        kwargs["max_memory"] = {d: "1000GiB" for d in cuda_devices}
    elif stage.quantization.startswith("bnb"):
        kwargs["device_map"] = {"": device.index or 0}
    ident = stage.model or ""
    try:
        model = AutoModelForCausalLM.from_pretrained(ident, **kwargs)
    except (OSError, ValueError) as err:
        if Path(ident).exists() and not isinstance(err, OSError):
            raise
        raise _unavailable(stage.name, ident, err) from err
    if "device_map" not in kwargs:
        model = model.to(device)
    return model


def _int8_dynamic(model: torch.nn.Module) -> torch.nn.Module:
    from torch.ao.quantization import quantize_dynamic

    return quantize_dynamic(model.float().cpu(), {torch.nn.Linear}, dtype=torch.qint8)


def _load_torch_model(
    hier: HierarchyConfig, index: int, device: torch.device, cuda_devices: list[int]
) -> torch.nn.Module:
    stage = hier.stages[index]
    if stage.kind == "tiny":
        from pipespec_mpi.models.tiny import build_tiny

        return build_tiny(hier.tiny, stage.layers, stage.noise, index, DTYPES[stage.dtype]).to(device)
    if stage.kind == "random":
        assert stage.shape is not None
        return random_llama(stage.shape, device, DTYPES[stage.dtype], seed=hier.tiny.seed * 1000 + index)
    if stage.kind == "hf":
        return _from_pretrained(stage, device, cuda_devices)
    if stage.kind == "gguf":
        return _from_pretrained(stage, device, cuda_devices, gguf_file=stage.gguf_file)
    if stage.kind == "smollm2":
        path = ensure_cache()
        return _from_pretrained(
            StageConfig(**{**stage.__dict__, "kind": "hf", "model": str(path)}),
            device,
            cuda_devices,
        )
    if stage.kind in ("int8_copy", "lowbit_copy"):
        assert stage.copy_of is not None
        src = _load_torch_model(hier, stage.copy_of, torch.device("cpu"), [])
        if device.type != "cpu":
            raise ValueError(f"stage {stage.name!r}: {stage.kind} runs on CPU only")
        if stage.kind == "int8_copy":
            return _int8_dynamic(src)
        from pipespec_mpi.models.cpu.lowbit import use_lowbit_linear

        use_lowbit_linear(src.float(), stage.weights, dense=stage.dense_rows)
        return src
    raise ValueError(f"stage {stage.name!r}: kind {stage.kind!r} has no torch model")


def load_stage(
    hier: HierarchyConfig, index: int, cuda_devices: list[int], kernels: str = "auto", compiled: bool = False
) -> Scorer | Proposer:
    """The model of stage ``index`` on this rank's device: a Scorer, or a Proposer. Every Llama
    stage runs the engine (models/engine.py) with ``kernels``' plug-ins (``device.kernels``:
    "auto", a CPU's kernels where they build; "portable", torch's linears and SDPA); other
    architectures run transformers' forward (models/fallback.py), logged with what they lose.
    ``compiled``: the engine's forward under torch.compile (``device.compile``)."""
    stage = hier.stages[index]
    if stage.kind == "prompt_lookup":
        return PromptLookup(stage.name, stage.ngram, stage.max_proposal)
    if stage.kind == "suffix":
        return _suffix_drafter(hier, stage)
    device = torch.device(stage_device(hier, index, cuda_devices))
    devices = [device]
    if device.type == "cuda" and stage.device == "auto" and len(cuda_devices) > 1:
        devices = [torch.device(f"cuda:{i}") for i in cuda_devices]  # its layers split over them
    if stage.quantization == "int4":  # read on the host, quantized onto the device linear by linear
        from pipespec_mpi.models.int4 import quantize_int4

        model = quantize_int4(
            _load_torch_model(hier, index, torch.device("cpu"), []), devices, stage.int4_group
        )
    elif len(devices) > 1 and not stage.quantization.startswith("bnb"):  # read on the host, then split
        model = _load_torch_model(hier, index, torch.device("cpu"), [])
        if (why := unsupported_reason(model)) is not None:
            raise ModelUnavailable(
                f"stage {stage.name!r}: n_gpus={len(devices)} splits its layers inside the engine, which "
                f"cannot run this model ({why}): give it one GPU (n_gpus=1), or quantization=int4"
            )
        model = spread(model, devices)
    else:  # one device; bitsandbytes over several through accelerate
        model = _load_torch_model(
            hier, index, device, cuda_devices if stage.quantization.startswith("bnb") else []
        )
    model = model.eval()
    exact_rows = stage.exact_rows
    if exact_rows is None and index == hier.n_stages - 1:
        exact_rows = True  # the output's stage: exact with or without the row kernel
    return model_scorer(
        stage.name, model, kernels=kernels, exact_rows=exact_rows, compiled=compiled,
        flat_linear=stage.flat_linear, exact_blocks=stage.exact_blocks,
    )  # fmt: skip


def model_scorer(
    name: str,
    model: torch.nn.Module,
    *,
    kernels: str = "auto",
    exact_rows: bool | None = None,
    compiled: bool = False,
    flat_linear: bool = True,
    exact_blocks: bool = True,
) -> Scorer:
    """A transformers causal LM as a stage's scorer: the engine with ``kernels``' plug-ins (on a
    CPU with "auto": float32 linears on the flat kernel, reading exact blocks where they have
    them, and ``exact_rows``' attention: models/cpu/plugins.py), or transformers' forward where
    the engine cannot run the model (logged with what that loses)."""
    device = next(model.parameters()).device
    why = unsupported_reason(model)
    if why is not None:
        from pipespec_mpi.models.fallback import LOSES, TransformersScorer, use_sdpa_gqa

        log.warning("%s: transformers forward, the engine cannot run it (%s): %s", name, why, LOSES)
        if device.type == "cpu":  # on CUDA, SDPA with a mask and enable_gqa falls back to its math kernel
            use_sdpa_gqa(model)
        return TransformersScorer(name, model, device)
    if engine_kernels(kernels, device.type) == "cpu":
        from pipespec_mpi.models.cpu.plugins import cpu_weights

        if flat_linear and model.model.embed_tokens.weight.dtype == torch.float32:
            from pipespec_mpi.models.cpu.flat_linear import use_flat_linear
            from pipespec_mpi.models.cpu.lowbit import read_exact_blocks

            use_flat_linear(model)
            if exact_blocks:
                read_exact_blocks(model)
        weights = cpu_weights(model, exact_rows)
    else:
        weights = Weights.of(model)
    if compiled and (why := weights.uncompilable()) is not None:
        log.warning(
            "%s: device.compile: the forward runs eager (%s; device.kernels=portable compiles)", name, why
        )
        compiled = False
    n = getattr(model.config, "max_position_embeddings", None)
    engine = Engine(weights, max_context=int(n) if n else None, compiled=compiled)
    log.info("%s: %s", name, engine.describe())
    return EngineScorer(name, engine)


def _suffix_drafter(hier: HierarchyConfig, stage: StageConfig) -> SuffixDrafter:
    corpus = None
    if stage.corpus:
        tok = load_tokenizer(hier.tokenizer, hier.name)
        corpus = read_corpus(stage.corpus, tok.encode, stage.store_tokens)
    return SuffixDrafter(
        stage.name, max_proposal=stage.max_proposal, max_match=stage.max_match,
        min_survival=stage.min_survival, store_tokens=stage.store_tokens, corpus=corpus,
    )  # fmt: skip


def load_tokenizer(cfg: TokenizerConfig, hier_name: str) -> Tokenizer:
    if cfg.kind == "bytes":
        return ByteTokenizer(cfg.eos_token_id)
    from transformers import AutoTokenizer

    if cfg.kind == "smollm2":
        return HFTokenizer(AutoTokenizer.from_pretrained(ensure_cache()), cfg.eos_token_id)
    ident = cfg.path or ""
    kwargs = {"local_files_only": not allow_download()}
    if cfg.kind == "gguf":
        kwargs["gguf_file"] = cfg.gguf_file
    try:
        tok = AutoTokenizer.from_pretrained(ident, **kwargs)
    except (OSError, ValueError) as err:
        raise _unavailable(f"tokenizer of {hier_name}", ident, err) from err
    return HFTokenizer(tok, cfg.eos_token_id)


def stage_tokenizer(hier: HierarchyConfig, index: int) -> Tokenizer | None:
    """The tokenizer that ships with stage ``index``'s weights (None for model-free stages)."""
    stage = hier.stages[index]
    if stage.kind in DRAFTER_KINDS:
        return None
    if stage.kind in ("int8_copy", "lowbit_copy"):
        assert stage.copy_of is not None
        return stage_tokenizer(hier, stage.copy_of)
    if stage.kind in ("tiny", "random"):
        return ByteTokenizer(hier.tokenizer.eos_token_id)
    if stage.kind == "smollm2":
        cfg = TokenizerConfig(kind="smollm2", eos_token_id=hier.tokenizer.eos_token_id)
    else:
        cfg = TokenizerConfig(
            kind="gguf" if stage.kind == "gguf" else "hf",
            path=stage.model,
            gguf_file=stage.gguf_file,
            eos_token_id=hier.tokenizer.eos_token_id,
        )
    try:
        return load_tokenizer(cfg, hier.name)
    except ModelUnavailable as err:
        raise ModelUnavailable(f"stage {stage.name!r}: {err}") from err


def tokenizer_mismatches(expected: str, stages: list[tuple[int, str, str | None]]) -> list[str]:
    """Stages whose tokenizer fingerprint differs from the hierarchy's (pure)."""
    return [
        f"stage {i} ({name}): tokenizer {fp} differs from the hierarchy's {expected}"
        for i, name, fp in stages
        if fp is not None and fp != expected
    ]
