"""The user's rows (``dataset=files``): JSONL and Parquet files, or a folder of them, read as a
stream, each row turned into a ``Request`` or, when it cannot be one, a ``BadRow`` saying why.

A row is one of
  {"prompt": "...", "id": ..., "max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 50,
   "seed": 1}                                  a plain prompt
  {"messages": [{"role": "user", "content": "..."}], ...}      chat turns (the template applied)
  {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions",
   "body": {"messages": [...], "max_tokens": ..., ...}}         an OpenAI batch request, as is
(``prompt``, ``messages`` and ``id`` renamed by ``dataset.prompt_field`` / ``messages_field`` /
``id_field``). A row's position is its 0-based index over the files' rows in order (a folder's
files sorted by name); a row without an id is named by its position, so every run of a file names
its rows alike. Parsing is pure (``parse_row``): readers only say where a row came from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pipespec_mpi.data.config import DatasetConfig
from pipespec_mpi.errors import UserError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
ROLES = ("system", "user", "assistant", "tool", "developer")


class DatasetError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class RowSettings:
    """A row's own settings; None: the job's (``decode.max_new_tokens``, ``sampling.*``)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    def sampling(self, job: Any) -> Any:
        """The job's ``SamplingConfig`` with this row's settings in place of its own."""
        own = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "seed")}
        return replace(job, **{k: v for k, v in own.items() if v is not None})


@dataclass(frozen=True)
class Request:
    """One row asking for a completion: a prompt text, or chat turns."""

    id: str
    position: int
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) per turn
    settings: RowSettings = field(default_factory=RowSettings)
    openai: bool = False  # read from an OpenAI batch request (its output line answers in kind)
    source: str = ""  # file:line (JSONL) or file#row (Parquet); built-in datasets: their name

    @property
    def chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True)
class BadRow:
    """A row that is not decoded, and why (one line of errors.jsonl)."""

    position: int
    source: str  # file:line (JSONL) or file#row (Parquet)
    reason: str
    id: str | None = None

    def to_json(self) -> dict:
        return {"id": self.id, "position": self.position, "source": self.source, "reason": self.reason}


# --------------------------------------------------------------------------------------------
# one row


class _Bad(ValueError):
    """What is wrong with a row (turned into a ``BadRow`` with its place)."""


def _int_setting(v: Any, name: str, low: int) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) and not (isinstance(v, float) and v.is_integer()):
        raise _Bad(f"{name}={v!r}: must be an integer")
    if int(v) < low:
        raise _Bad(f"{name}={v!r}: must be >= {low}")
    return int(v)


def _float_setting(v: Any, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _Bad(f"{name}={v!r}: must be a number")
    if v < low or v > high or (low_open and v == low):
        raise _Bad(f"{name}={v!r}: must be in {'(' if low_open else '['}{low}, {high}]")
    return float(v)


def settings_of(obj: Mapping[str, Any]) -> RowSettings:
    """A row's (or an OpenAI body's) settings, checked; ``max_completion_tokens`` is the newer
    OpenAI name of ``max_tokens``."""
    mt = obj.get("max_tokens")
    if mt is None:
        mt = obj.get("max_completion_tokens")
    return RowSettings(
        max_tokens=_int_setting(mt, "max_tokens", 1),
        temperature=_float_setting(obj.get("temperature"), "temperature", 0.0, 100.0),
        top_p=_float_setting(obj.get("top_p"), "top_p", 0.0, 1.0, low_open=True),
        top_k=_int_setting(obj.get("top_k"), "top_k", 0),
        seed=_int_setting(obj.get("seed"), "seed", 0),
    )


def _content(value: Any, where: str) -> str:
    """A turn's content: a string, or OpenAI's list of parts of which only text ones are read."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, Mapping) for p in value):
        if any(p.get("type") != "text" for p in value):
            raise _Bad(f"{where}: only text content parts can be decoded")
        return "".join(str(p.get("text", "")) for p in value)
    raise _Bad(f"{where}: content must be a string or a list of text parts")


def messages_of(value: Any, name: str) -> tuple[tuple[str, str], ...]:
    if hasattr(value, "tolist"):  # a Parquet list column read through numpy
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise _Bad(f"{name}: must be a non-empty list of {{role, content}} turns")
    turns = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise _Bad(f"{name}[{i}]: a turn needs 'role' and 'content'")
        if m["role"] not in ROLES:
            raise _Bad(f"{name}[{i}]: role {m['role']!r} is not one of {ROLES}")
        turns.append((str(m["role"]), _content(m["content"], f"{name}[{i}].content")))
    return tuple(turns)


def _openai(obj: Mapping[str, Any], position: int) -> Request:
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise _Bad("an OpenAI batch request needs a string custom_id")
    url, body = obj.get("url", "/v1/chat/completions"), obj.get("body")
    if url not in OPENAI_URLS:
        raise _Bad(f"url {url!r}: only {OPENAI_URLS} can be answered")
    if not isinstance(body, Mapping):
        raise _Bad("body: must be an object")
    if body.get("n", 1) != 1:
        raise _Bad(f"body.n={body.get('n')!r}: one completion per request (sampling.num_samples for more)")
    settings = settings_of(body)
    if url == "/v1/chat/completions":
        return Request(cid, position, messages=messages_of(body.get("messages"), "body.messages"),
                       settings=settings, openai=True)  # fmt: skip
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise _Bad("body.prompt: must be a string (one prompt per request)")
    return Request(cid, position, text=prompt, settings=settings, openai=True)


def parse_row(obj: Any, position: int, ds: DatasetConfig) -> Request:
    """The request a decoded row asks for; ``_Bad`` says what does not fit."""
    if not isinstance(obj, Mapping):
        raise _Bad(f"a row must be an object, got {type(obj).__name__}")
    if obj.get("custom_id") is not None and obj.get("body") is not None:  # (a Parquet null is None)
        return _openai(obj, position)
    rid = obj.get(ds.id_field)
    rid = str(position) if rid is None else str(rid)
    settings = settings_of(obj)
    prompt, messages = obj.get(ds.prompt_field), obj.get(ds.messages_field)
    if prompt is not None and messages is not None:
        raise _Bad(f"both {ds.prompt_field!r} and {ds.messages_field!r}: give one")
    if messages is not None:
        return Request(rid, position, messages=messages_of(messages, ds.messages_field), settings=settings)
    if not isinstance(prompt, str):
        raise _Bad(f"needs a string field {ds.prompt_field!r} or a list {ds.messages_field!r}")
    return Request(rid, position, text=prompt, settings=settings)


def _row_id(obj: Any, ds: DatasetConfig) -> str | None:
    if not isinstance(obj, Mapping):
        return None
    rid = obj.get("custom_id", obj.get(ds.id_field))
    return None if rid is None else str(rid)


# --------------------------------------------------------------------------------------------
# files


def dataset_files(ds: DatasetConfig) -> list[Path]:
    """The files of ``dataset.path``: the file, or a folder's JSONL and Parquet files by name."""
    p = Path(ds.path or "")
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and _kind(f, ds, strict=False))
        if not files:
            raise DatasetError(f"dataset.path={ds.path!r}: no {JSONL_SUFFIXES + PARQUET_SUFFIXES} file in it")
        return files
    raise DatasetError(f"dataset.path={ds.path!r}: no such file or folder")


def _kind(path: Path, ds: DatasetConfig, strict: bool = True) -> str | None:
    if ds.file_format != "auto":
        return ds.file_format
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if strict:
        raise DatasetError(f"{path}: not a JSONL or Parquet file by its name; set dataset.file_format")
    return None


Raw = tuple[int, str, Any]  # (position, source, the decoded row, a _Bad, or None: not wanted)
Wanted = Callable[[int], bool]


def _jsonl_rows(path: Path, first: int, wanted: Wanted) -> Iterator[Raw]:
    """A JSONL file's rows; a row not ``wanted`` is counted, never decoded (None)."""
    position = first
    with open(path, encoding="utf-8", errors="strict") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj: Any = None
            if wanted(position):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as err:
                    obj = _Bad(f"not JSON ({err.msg})")
            yield position, f"{path}:{n}", obj
            position += 1


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DatasetError("reading Parquet needs pyarrow (bash scripts/setup.sh installs it)") from err
    try:
        return pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise DatasetError(f"{path}: not a Parquet file ({err})") from err


def _parquet_rows(path: Path, first: int, wanted: Wanted) -> Iterator[Raw]:
    """A Parquet file's rows, a row group at a time (never the whole file); a group with no
    wanted row is skipped unread."""
    pf = _parquet_file(path)
    position = first
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if not any(wanted(p) for p in range(position, position + n)):
            yield from ((p, f"{path}#{p - first}", None) for p in range(position, position + n))
            position += n
            continue
        for row in pf.read_row_group(g).to_pylist():
            yield position, f"{path}#{position - first}", row if wanted(position) else None
            position += 1


def raw_rows(ds: DatasetConfig, wanted: Wanted = lambda p: True) -> Iterator[Raw]:
    """Every row of the dataset's files in order, with its place: decoded (or a ``_Bad``) when
    ``wanted(position)``, else None (counted, not decoded: a shard reads only its own rows)."""
    position = 0
    for path in dataset_files(ds):
        read = _parquet_rows if _kind(path, ds) == "parquet" else _jsonl_rows
        for raw in read(path, position, wanted):
            yield raw
            position = raw[0] + 1


def count_rows(ds: DatasetConfig) -> int:
    """The dataset's rows, none decoded (Parquet: from the files' metadata)."""
    n = 0
    for path in dataset_files(ds):
        if _kind(path, ds) == "parquet":
            n += _parquet_file(path).metadata.num_rows
        else:
            n += sum(1 for _ in _jsonl_rows(path, 0, lambda p: False))
    return n


def read_requests(ds: DatasetConfig, wanted: Wanted = lambda p: True) -> Iterator[Request | BadRow]:
    """The dataset's ``wanted`` rows as requests, in file order; a row that is not one is a
    ``BadRow``."""
    for position, source, obj in raw_rows(ds, wanted):
        if obj is None:
            continue
        if isinstance(obj, _Bad):
            yield BadRow(position, source, str(obj))
            continue
        try:
            yield replace(parse_row(obj, position, ds), source=source)
        except _Bad as err:
            yield BadRow(position, source, str(err), _row_id(obj, ds))
