"""The files of a run directory as types (docs/outputs.md).

- ``Record``: one line of ``results.jsonl`` (and of ``parts/replica-<r>.jsonl``): one (prompt,
  method, sample), with one ``StageStats`` per stage, as each stage sent it. ``iter_records`` is
  the one reader of these files; ``Record.to_line`` is what every writer writes.
- ``MethodSummary`` (``summary.json``, per method) and ``BenchmarkRow`` (``benchmark.json``, per
  method), each written and read by one function.

Reading is forward and backward compatible: keys a reader does not know are ignored, and fields
that older runs did not write yet take their defaults. Anything else that does not fit (not JSON,
not an object, a required field missing, a value of the wrong type) is a ``RecordError`` naming the
file and the line, except a torn last line of a results file (a job killed mid-write), which is
reported on stderr and skipped.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import MISSING, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from pipespec_mpi.errors import UserError
from pipespec_mpi.stage.stats import StageStats

RESULTS = "results.jsonl"
SUMMARY = "summary.json"
BENCHMARK = "benchmark.json"
ERRORS = "errors.jsonl"  # the rows not decoded: id, position, source, reason (data/requests.py BadRow)


class RecordError(UserError, ValueError):
    """A run-directory file that does not hold what its format says (``line``: 1-based, or None
    for a whole-file JSON document)."""

    def __init__(self, path: str | Path, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = Path(path), line, reason
        super().__init__(f"{path}:{line}: {reason}" if line is not None else f"{path}: {reason}")

    def __reduce__(self):  # pickled to the other ranks (a resumed run's records are read on rank 0)
        return type(self), (self.path, self.line, self.reason), self.__dict__


class _Malformed(ValueError):
    """What is wrong with one JSON value (turned into a ``RecordError`` with its place)."""


# --------------------------------------------------------------------------------------------
# results.jsonl


@dataclass(kw_only=True)
class Record:
    """One line of results.jsonl. Field order is the order of the keys on disk."""

    prompt_id: str
    """the row's id (or one made from its position)"""
    replica: int
    """the pipeline replica that decoded it"""
    method: str
    """ar | sd | pipespec | online"""
    warmup: bool
    """benchmark warm-up: excluded from aggregates"""
    sample_idx: int = 0
    """which of sampling.num_samples"""
    batch_size: int = 1
    """sequences in flight per stage while this one decoded (stage/batch.py)"""
    slot: int = 0
    """which of them"""
    phase: int | None = None
    """its phase: the number of the phase's first job (None: not recorded)"""
    decoded_by: str | None = None
    """method=online: the plan it ran ("pipespec 0-2", "ar"; run/online.py)"""
    route: list[int] | None = None
    """the stages that decoded it (None: all; AR: the last alone)"""
    plan_note: str | None = None
    """method=online: why that plan"""
    temperature: float = 0.0
    """the job's, or its row's own"""
    top_p: float = 1.0
    """see ``temperature``"""
    top_k: int = 0
    """see ``temperature``"""
    coupling: str = "leviathan"
    """leviathan | gumbel (sampling.coupling)"""
    position: int | None = None
    """the row's place in the dataset (data/requests.py)"""
    request: str = "prompt"
    """prompt | chat (turns through the chat template)"""
    openai: bool = False
    """the row was an OpenAI batch request"""
    truncated_tokens: int = 0
    """prompt tokens cut away (dataset.truncate)"""
    end_time: float | None = None
    """Unix time the record was written (progress, ETA)"""
    bytes_sent: list[int] = field(default_factory=list)
    """per stage"""
    seq: int
    """the record's order in the job (by writing)"""
    prompt_ids: list[int]
    """the prompt's token ids (after the chat template and truncation)"""
    output_ids: list[int]
    """generated ids only, a final EOS included"""
    text: str
    """the output decoded to text"""
    n_new_tokens: int
    """tokens generated (``len(output_ids)``)"""
    finish_reason: str
    """eos | length"""
    wall_s: float
    """prefill + decode, from the start barrier"""
    ms_per_token: float
    """wall_s over n_new_tokens"""
    ttft_s: float
    """seconds to the first committed token"""
    window: int | None
    """proposals a verifier waits for: SD's window or PipeSpec's lookahead"""
    max_run_ahead: int | None = None
    """decode.max_run_ahead (PipeSpec)"""
    max_verify: int | None = None
    """decode.max_verify (PipeSpec)"""
    policy: str = "static"
    """decode.policy the stages decided by (speculative/goodput.py)"""
    draft_survival: float | None = None
    """decode.draft_survival under the adaptive policy"""
    max_new_tokens: int
    """this job's budget: the row's max_tokens, else decode.max_new_tokens"""
    transport: str
    """the links' transport as resolved (mpi, gloo, nccl, strict)"""
    epochs_window: str | None = None
    """shared | push | rma (comm/window.py); None: before it was recorded"""
    hosts: list[str] = field(default_factory=list)
    """per stage: the host it ran on"""
    engines: list[str] = field(default_factory=list)
    """per stage: the forward and plug-ins it ran"""
    seams: list[str] = field(default_factory=list)
    """per stage: what the device seam decided for its rank (platforms.py ``Resolved``: device,
    kernels, compilation, transport, threads, waiting)"""
    hierarchy: str | None
    """the hierarchy's name"""
    models: list[str]
    """per stage: its name"""
    stages: list[StageStats]
    """per stage: what it recorded (``StageStats``)"""

    def pairs(self) -> list[tuple[int, int]]:
        """(proposer, verifier) of each stage that verified proposals in this job: adjacent stages,
        or on its ``route`` the route's neighbours ("0->2" where stage 1 sat the job out)."""
        stages = self.route if self.route is not None else list(range(len(self.stages)))
        return list(zip(stages, stages[1:]))

    def to_json(self) -> dict:
        """The record as a JSON object (what one line of results.jsonl holds): equal to
        ``dataclasses.asdict(self)``, without its deep copy (``_plain``)."""
        return _plain(self)

    def to_line(self) -> str:
        """The record as one line of a results file or a part, newline included: the one place
        a record is serialized."""
        return json.dumps(self.to_json()) + "\n"

    @classmethod
    def from_json(cls, obj: Any) -> Record:
        """The record of a decoded JSON line; ``_Malformed`` says what does not fit. Records
        written before the field was named ``window`` hold it as ``lookahead``."""
        if isinstance(obj, dict) and "window" not in obj and "lookahead" in obj:
            obj = {**obj, "window": obj["lookahead"]}
        return _load(cls, obj, "record", {"stages": _stage_list})


def _plain(v: Any) -> Any:
    """A dataclass as nested dicts, sharing every other value instead of copying it: what
    ``dataclasses.asdict`` gives, for ``json.dumps``, which reads it and keeps nothing. (asdict
    deep-copies every list, a record's stage timelines included, which made it most of rank 0's
    finalize: docs/notebook.md, "Measurements behind the code's choices".)"""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, list) and v and dataclasses.is_dataclass(v[0]):
        return [_plain(x) for x in v]
    return v


def _stage_list(value: Any, where: str) -> list[StageStats]:
    if not isinstance(value, list):
        raise _Malformed(f"{where}: expected a list of stages, got {type(value).__name__}")
    return [_load(StageStats, s, f"{where}[{i}]") for i, s in enumerate(value)]


def read_records(path: str | Path) -> list[Record]:
    """``iter_records`` as a list."""
    return list(iter_records(path))


def iter_records(path: str | Path) -> Iterator[Record]:
    """The records of a results file (results.jsonl or a part), in file order, one line at a
    time; blank lines are skipped. A line that is not a record raises ``RecordError`` (file and
    line), except a torn last line (no final newline: a job killed mid-write), which is reported
    on stderr and skipped."""
    with open(path, encoding="utf-8", newline="\n") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                if not line.endswith("\n"):
                    print(f"[pipespec_mpi] {path}:{i}: skipping a torn last line (a job killed mid-write)",
                          file=sys.stderr)  # fmt: skip
                    continue
                raise RecordError(path, i, f"not JSON: {err.msg} (column {err.colno})") from None
            try:
                yield Record.from_json(obj)
            except _Malformed as err:
                raise RecordError(path, i, str(err)) from None


def write_records(path: str | Path, records: Iterable[Record]) -> None:
    """A results file: one record per line."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(r.to_line() for r in records)


def write_errors(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """errors.jsonl: one bad row per line (``BadRow.to_json()``: id, position, source, reason)."""
    with open(path, "w", encoding="utf-8") as f:
        for b in rows:
            f.write(json.dumps(dict(b)) + "\n")


def read_errors(path: str | Path) -> list[dict]:
    """The lines of an errors.jsonl (none when the file is absent)."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise RecordError(path, i, f"not JSON: {err.msg}") from None
    return out


def drop_torn_tail(path: str | Path) -> bool:
    """Before appending to a results file: end its last line, so the next record starts a line of
    its own. A last line without its newline that is not JSON is torn (a job killed mid-write):
    it is cut off (its job was not counted as done, so it runs again) and reported on stderr;
    one that is whole only gets its newline. True when something was cut."""
    path = Path(path)
    if not path.is_file():
        return False
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    keep = data.rfind(b"\n") + 1
    try:
        json.loads(data[keep:])
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        line = data.count(b"\n") + 1
        print(f"[pipespec_mpi] {path}:{line}: dropping a torn last line (a job killed mid-write); "
              "its job runs again", file=sys.stderr)  # fmt: skip
        with open(path, "r+b") as f:
            f.truncate(keep)
        return True
    with open(path, "ab") as f:
        f.write(b"\n")
    return False


# --------------------------------------------------------------------------------------------
# summary.json


@dataclass
class PairAcceptance:
    """Acceptance at one adjacent stage pair (``metrics.acceptance``)."""

    verifications: int
    """the verifier's verifications of the proposer's tokens"""
    proposed: int
    """tokens verified"""
    accepted: int
    """tokens accepted"""
    mean_accepted: float
    """accepted per verification"""
    mean_acceptance_length: float
    """1 + accepted / verifications"""
    acceptance_rate: float
    """accepted / proposed"""
    per_position_acceptance: list[float]
    """per proposal position: how often a token there was accepted"""
    accepted_histogram: list[int]
    """verifications by tokens accepted (index k: k accepted)"""


@dataclass
class StageSummary:
    model: str
    """the stage's model"""
    forward_calls: int
    """forwards, over the records"""
    rollbacks: int
    """times it was rolled back"""
    tokens_discarded: int
    """its tokens thrown away by rollbacks"""
    discarded_s: float
    """compute time spent on those tokens"""
    busy_fraction: float
    """its compute time over the wall"""
    verifications: int = 0
    """its forwards that verified proposals"""
    own_steps: int = 0
    """its one-token steps of its own"""
    proposals_per_forward: float = 0.0
    """a verifier's forwards that verified a proposal (the rest were steps of its own)"""
    tokens_per_forward: float = 0.0
    """tokens committed by its own actions per forward"""
    waits_chosen: int = 0
    """the adaptive policy (decode.policy=adaptive): waits it chose although it could act"""
    waits_joined: int = 0
    """waits it would have chosen, given up to join its other slots' forward"""
    verify_cut: int = 0
    """the adaptive policy's verifications of fewer proposals than were pending"""
    drafts_held: int = 0
    """the adaptive policy's holds of its drafting (decode.draft_survival)"""
    drafter: dict[str, dict[str, float]] = field(default_factory=dict)
    """a model-free stage 0, per source (models/suffix.py): proposals, proposed, accepted (tokens the next
    stage committed as proposed), mean_accepted (accepted per proposal)"""
    cpu_cores: float | None = None
    """the cores its rank kept busy, computing or waiting, while it worked on these records (process CPU
    time over its clock's time; metrics._CpuSpans); None: no such time recorded"""


@dataclass
class MethodSummary:
    """One method's entry of summary.json: aggregates over its non-warm-up records."""

    n_prompts: int
    """records aggregated"""
    n_tokens: int
    """tokens they generated"""
    wall_s: float
    """decoding time: the records' walls summed (batch 1), the phases' spans (batched)"""
    ms_per_token: float
    """wall_s / n_tokens: the inverse of the throughput"""
    tokens_per_s: float
    """n_tokens / wall_s"""
    ttft_s_mean: float
    """mean seconds to the first token"""
    token_latency_ms: dict[str, float]
    """p50, p90, p99"""
    acceptance: dict[str, PairAcceptance]
    """per pair "0->1", ..."""
    mean_accepted_per_verification: dict[str, float]
    """per pair: accepted tokens per verification"""
    stages: list[StageSummary]
    """per stage"""
    peak_rss_mb: list[float] = field(default_factory=list)
    """per stage"""
    batch_size: int = 1
    """sequences decoded together (the entry's key says it too)"""
    sequence_ms_per_token: dict[str, float] = field(default_factory=dict)
    """each sequence's own ms/token (its wall over its tokens: the latency a user of one prompt sees): p50,
    p90, mean"""
    rows_not_decoded: int = 0
    """the run's rows in errors.jsonl (the same in every method's entry)"""
    core_hours_per_million_tokens: float | None = None
    """the CPUs (GPUs) a replica's ranks hold times the decoding wall, per million tokens"""
    gpu_hours_per_million_tokens: float | None = None
    """see ``core_hours_per_million_tokens``"""
    energy_j_per_token_system: float | None = None
    """GPU runs only (absent from the file otherwise)"""
    energy_j_per_token_per_gpu: float | None = None
    """see ``energy_j_per_token_system``"""
    n_gpus_measured: int | None = None
    """see ``energy_j_per_token_system``"""
    method: str = ""
    """what the entry is of, as fields (its key in the file, ``group_key``, says the same; files written
    before the fields existed get them from the key when read)"""

    def to_json(self) -> dict:
        return _without_none(dataclasses.asdict(self), ("energy_j_per_token_system",
                             "energy_j_per_token_per_gpu", "n_gpus_measured",
                             "core_hours_per_million_tokens", "gpu_hours_per_million_tokens"))  # fmt: skip

    @classmethod
    def from_json(cls, obj: Any, where: str = "summary") -> MethodSummary:
        def pairs(v: Any, w: str) -> dict[str, PairAcceptance]:
            return {k: _load(PairAcceptance, a, f"{w}[{k!r}]") for k, a in _object(v, w).items()}

        def stages(v: Any, w: str) -> list[StageSummary]:
            return [_load(StageSummary, s, f"{w}[{i}]") for i, s in enumerate(_list(v, w))]

        return _load(cls, obj, where, {"acceptance": pairs, "stages": stages})


def write_summary(path: str | Path, summary: Mapping[str, MethodSummary]) -> None:
    _write_doc(path, {m: s.to_json() for m, s in summary.items()})


def read_summary(path: str | Path) -> dict[str, MethodSummary]:
    return _read_doc(path, MethodSummary.from_json)


# --------------------------------------------------------------------------------------------
# benchmark.json


@dataclass
class SpeedupPerPrompt:
    """Per-prompt ratios of AR's ms/token over the method's, over prompts both decoded."""

    median: float
    """the median ratio"""
    min: float
    """the smallest"""
    max: float
    """the largest"""
    n: int
    """prompts compared"""


@dataclass
class BenchmarkRow:
    """One method's entry of benchmark.json (``speedup``: only with an AR run)."""

    n_prompts: int
    """see ``MethodSummary``"""
    n_tokens: int
    """see ``MethodSummary``"""
    wall_s: float
    """see ``MethodSummary``"""
    ms_per_token: float
    """see ``MethodSummary``"""
    tokens_per_s: float
    """see ``MethodSummary``"""
    mean_accepted_per_verification: dict[str, float]
    """see ``MethodSummary``"""
    busy_fraction: list[float]
    """per stage"""
    batch_size: int = 1
    """see ``MethodSummary``"""
    sequence_ms_per_token: dict[str, float] = field(default_factory=dict)
    """p50, p90, mean"""
    speedup: float | None = None
    """tokens/s over AR's at the same batch size"""
    speedup_per_prompt: SpeedupPerPrompt | None = None
    """AR's ms/token over this method's per prompt (``SpeedupPerPrompt``)"""
    method: str = ""
    """as in MethodSummary: the entry's method (batch_size: its batch size)"""

    def to_json(self) -> dict:
        return _without_none(dataclasses.asdict(self), ("speedup", "speedup_per_prompt"))

    @classmethod
    def from_json(cls, obj: Any, where: str = "benchmark") -> BenchmarkRow:
        def per_prompt(v: Any, w: str) -> SpeedupPerPrompt | None:
            return None if v is None else _load(SpeedupPerPrompt, v, w)

        return _load(cls, obj, where, {"speedup_per_prompt": per_prompt})


def write_benchmark(path: str | Path, bench: Mapping[str, BenchmarkRow]) -> None:
    _write_doc(path, {m: row.to_json() for m, row in bench.items()})


def read_benchmark(path: str | Path) -> dict[str, BenchmarkRow]:
    return _read_doc(path, BenchmarkRow.from_json)


# --------------------------------------------------------------------------------------------
# checking JSON against the dataclasses


def _without_none(d: dict, keys: Iterable[str]) -> dict:
    return {k: v for k, v in d.items() if not (k in keys and v is None)}


def _write_doc(path: str | Path, doc: dict) -> None:
    Path(path).write_text(json.dumps(doc, indent=2))


def _read_doc(path: str | Path, load: Callable[[Any, str], Any]) -> dict:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise RecordError(path, err.lineno, f"not JSON: {err.msg} (column {err.colno})") from None
    try:
        out = {m: load(v, repr(m)) for m, v in _object(doc, "the file").items()}
    except _Malformed as err:
        raise RecordError(path, None, str(err)) from None
    for key, entry in out.items():  # written before the entries named their method
        if not entry.method:
            entry.method, entry.batch_size = parse_group_key(key)
    return out


def group_key(method: str, batch_size: int) -> str:
    """The key of a method's entry at a batch size in summary.json and benchmark.json:
    ``pipespec`` at batch 1 (as before batching), ``pipespec@b4`` at 4. Readers use the entries'
    ``method`` and ``batch_size`` fields (``find_entry``); the key is for people and old files."""
    return method if batch_size == 1 else f"{method}@b{batch_size}"


def parse_group_key(key: str) -> tuple[str, int]:
    """(method, batch size) of a ``group_key``: only for files older than the fields."""
    method, _, b = key.partition("@b")
    return method, int(b or 1)


_E = typing.TypeVar("_E", "MethodSummary", "BenchmarkRow")


def find_entry(doc: Mapping[str, _E], method: str, batch_size: int = 1) -> _E | None:
    """The entry of summary.json or benchmark.json for ``method`` at ``batch_size``, by its fields."""
    return next((e for e in doc.values() if e.method == method and e.batch_size == batch_size), None)


def _object(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise _Malformed(f"{where}: expected an object, got {type(v).__name__}")
    return v


def _list(v: Any, where: str) -> list:
    if not isinstance(v, list):
        raise _Malformed(f"{where}: expected a list, got {type(v).__name__}")
    return v


@cache
def _schema(cls: type) -> tuple[tuple[str, tuple[type, ...], bool], ...]:
    """(name, accepted JSON types, required) per field of a dataclass."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, _json_types(hints[f.name]), f.default is MISSING and f.default_factory is MISSING)
        for f in dataclasses.fields(cls)
    )


_JSON_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
               dict: "an object", type(None): "null"}  # fmt: skip


def _json_types(hint: Any) -> tuple[type, ...]:
    """The JSON value types a field annotation admits (the outer container only)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return tuple(t for a in typing.get_args(hint) for t in _json_types(a))
    if hint is type(None):
        return (type(None),)
    if hint is float:
        return (int, float)
    if dataclasses.is_dataclass(hint):
        return (dict,)
    return (origin or hint,)


def _load(cls: type, obj: Any, where: str, nested: Mapping[str, Callable[[Any, str], Any]] | None = None):
    """A ``cls`` from a JSON object: required fields present, values of the annotated types
    (``nested`` converts the fields it names), unknown keys ignored."""
    obj = _object(obj, where)
    kw = {}
    for name, accepted, required in _schema(cls):
        if name not in obj:
            if required:
                raise _Malformed(f"{where}: missing field {name!r}")
            continue
        v = obj[name]
        if nested and name in nested:
            v = nested[name](v, f"{where}.{name}")
        elif not isinstance(v, accepted) or (isinstance(v, bool) and bool not in accepted):
            shown = json.dumps(v)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            names = [_JSON_NAMES.get(t, t.__name__) for t in accepted if not (t is int and float in accepted)]
            want = " or ".join(names)
            raise _Malformed(f"{where}: {name}={shown} is not {want}")
        kw[name] = v
    return cls(**kw)
