"""What a job reads: ``DatasetConfig`` (the ``dataset`` node), the only home of its defaults, and
its validation (``problems``, called once by ``config.validate``)."""

from __future__ import annotations

from dataclasses import dataclass

from pipespec_mpi.choices import Choice


class DatasetName(Choice):
    humaneval = "humaneval"
    news = "news"
    files = "files"
    jsonl = "jsonl"
    synthetic = "synthetic"
    hub = "hub"


class FileFormat(Choice):  # auto: by each file's suffix (.jsonl/.json, .parquet)
    auto = "auto"
    jsonl = "jsonl"
    parquet = "parquet"


class Truncation(Choice):  # left: keep the first token and the end; right: keep the start
    left = "left"
    right = "right"


@dataclass
class DatasetConfig:
    """Which prompts (conf/dataset/<name>.yaml names the dataset and its files).

    ``files`` (alias ``jsonl``): the user's JSONL or Parquet file, or a folder of them, read as a
    stream in file order (data/requests.py). A row holds a ``prompt`` or chat ``messages`` (or is
    an OpenAI batch request: ``custom_id`` and ``body``), an optional ``id`` and its own
    ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``."""

    name: DatasetName = DatasetName.humaneval
    """humaneval, news (the Lee corpus), files (alias jsonl: the user's), synthetic, hub"""
    path: str | None = None
    """dataset=files: a .jsonl/.parquet file or a folder of them"""
    file_format: FileFormat = FileFormat.auto
    """files: auto (by each file's suffix: .jsonl/.json, .parquet), jsonl or parquet"""
    prompt_field: str = "prompt"
    """the row's fields, renamed for files that name them otherwise"""
    messages_field: str = "messages"
    """see ``prompt_field``"""
    id_field: str = "id"
    """see ``prompt_field``"""
    n_prompts: int | None = None
    """None: every row (the built-in benchmarks' configs say 4)"""
    shuffle: bool = False
    """a seeded shuffle before taking n_prompts (the benchmarks': true)"""
    seed: int = 0
    """the shuffle's (and the synthetic text's) seed"""
    chat_template: bool | None = None
    """None: the hierarchy's tokenizer.chat_template decides"""
    max_prompt_tokens: int = 512
    """a longer prompt is a bad row, unless ``truncate`` says how to cut"""
    truncate: Truncation | None = None
    """left: keep the first token and the end; right: keep the start"""
    round_rows: int = 4096
    """prompts per replica that rank 0 reads and deals out at a time (run/rows.py)"""
    shard_index: int = 0
    """job-level sharding (Slurm arrays): this job takes shard_index::shard_count"""
    shard_count: int = 1
    """see ``shard_index``"""
    hub_name: str | None = None
    """hub: the dataset's name (``name:config``), from the local Hugging Face cache only"""
    split: str = "test"
    """hub: the split read"""

    @property
    def user_files(self) -> bool:
        return self.name in ("files", "jsonl")


def problems(ds: DatasetConfig) -> list[str]:
    """Every offending value of the ``dataset`` node, named."""
    p = []
    if ds.user_files and not ds.path:
        p.append(f"dataset.path: required for dataset={ds.name}")
    if ds.n_prompts is not None and (not isinstance(ds.n_prompts, int) or ds.n_prompts < 1):
        p.append(f"dataset.n_prompts={ds.n_prompts}: must be an integer >= 1, or null for every row")
    if ds.name == "synthetic" and ds.n_prompts is None:
        p.append("dataset.n_prompts: dataset=synthetic needs a count (it has no end)")
    if ds.shard_count < 1 or not 0 <= ds.shard_index < ds.shard_count:
        p.append(
            f"dataset.shard_index={ds.shard_index}, dataset.shard_count={ds.shard_count}: "
            "need 0 <= shard_index < shard_count"
        )
    if not isinstance(ds.round_rows, int) or ds.round_rows < 1:
        p.append(f"dataset.round_rows={ds.round_rows}: must be an integer >= 1")
    if ds.max_prompt_tokens < 1:
        p.append(f"dataset.max_prompt_tokens={ds.max_prompt_tokens}: must be >= 1")
    for name in ("prompt_field", "messages_field", "id_field"):
        if not getattr(ds, name):
            p.append(f"dataset.{name}: must name a field")
    return p
