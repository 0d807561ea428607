"""Markdown references read from dataclasses: names, types and defaults (``dataclasses.fields``),
meanings from the field comments in the source (``tokenize``), headings from the class docstrings.

A field's meaning is its trailing comment and the ``#`` lines that continue it, or the ``#`` lines
right above it. A block of ``#`` lines between two fields continues the field above when that
one has a trailing comment and either the field below has one too or the comment above reads
unfinished (ends in ``,``/``:``/``(``, an open parenthesis, or a word such as "a", "of", "as");
otherwise it describes the field below, and the fields right after that one which have no comment
of their own share it (a comment over a group: they read "see `that field`"). A field without any
comment is listed with an empty meaning. ``config_reference`` renders the configuration tree
(docs/config.md); the outputs' reference (docs/outputs-fields.md) and the command that writes
both are in analysis/reference.py (records.py is in a higher layer than config/).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
import typing
from functools import cache

from pipespec_mpi.choices import choice_type
from pipespec_mpi.config.schema import AppConfig

_UNFINISHED_WORDS = {"a", "an", "the", "of", "to", "as", "and", "or", "but", "by", "with", "for", "in",
                     "on", "at", "from", "than", "that", "which", "its", "their", "is", "are", "be",
                     "into", "per"}  # fmt: skip


def _unfinished(text: str) -> bool:
    """Whether a comment breaks off mid-phrase (its next lines continue it)."""
    words = text.rstrip().split()
    return (text.count("(") > text.count(")") or text.rstrip().endswith((",", ":", ";", "(", "-"))
            or (bool(words) and words[-1].lower() in _UNFINISHED_WORDS))  # fmt: skip


def _comments(source: str) -> list[tuple[int, str, bool]]:
    """(row, text, trailing) of every comment of ``source``; tool directives (fmt:, noqa) left out."""
    lines = source.splitlines()
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if not text.startswith(("fmt:", "noqa", "type:")):
                out.append((tok.start[0], text, bool(lines[tok.start[0] - 1][: tok.start[1]].strip())))
    return out


@cache
def field_comments(cls: type) -> dict[str, str]:
    """Each field of the dataclass ``cls`` -> the text of its comment ("" where it has none)."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)).body
    spans = [((n.target.id if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) else None),
              n.lineno, n.end_lineno or n.lineno) for n in body]  # fmt: skip
    trailing: dict[str, list[str]] = {name: [] for name, _, _ in spans if name}
    blocks: list[tuple[int, int, list[str]]] = []  # (first row, last row, lines) of # lines
    for row, text, is_trailing in _comments(source):
        owner = next((name for name, a, b in spans if a <= row <= b), None)
        if is_trailing and owner:
            trailing[owner].append(text)
        elif not is_trailing and blocks and blocks[-1][1] == row - 1:
            blocks[-1] = (blocks[-1][0], row, [*blocks[-1][2], text])
        elif not is_trailing:
            blocks.append((row, row, [text]))
    above: dict[str, list[str]] = {name: [] for name in trailing}
    for first, last, lines in blocks:
        prev = max((s for s in spans if s[2] < first), key=lambda s: s[2], default=None)
        nxt = min((s for s in spans if s[1] > last), key=lambda s: s[1], default=None)
        prev_name = prev[0] if prev and prev[2] == first - 1 else None
        next_name = nxt[0] if nxt and nxt[1] == last + 1 else None
        if (
            prev_name
            and trailing[prev_name]
            and (next_name is None or trailing[next_name] or _unfinished(" ".join(trailing[prev_name])))
        ):
            trailing[prev_name] += lines  # a continuation
        elif next_name:
            above[next_name] += lines
    out: dict[str, str] = {}
    leader, last_end = "", -1  # the field whose comment above it its uncommented followers share
    for name, start, end in spans:
        own = " ".join(above[name] + trailing[name]) if name else ""
        if name and own:
            out[name], leader = own, (name if not trailing[name] else "")
        elif name:
            leader = leader if start == last_end + 1 else ""
            out[name] = f"see ``{leader}``" if leader else ""
        else:
            leader = ""
        last_end = end
    return {f.name: _markdown(out.get(f.name, "")) for f in dataclasses.fields(cls)}


def _markdown(text: str) -> str:
    """RST ``code`` as Markdown `code`."""
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def cell(text: str) -> str:
    """Text for a Markdown table cell (pipes escaped)."""
    return text.replace("|", "\\|")


def heading_text(cls: type) -> str:
    """The first paragraph of the class's own docstring, on one line ("" where it has none:
    ``dataclass`` writes "Name(field: type, ...)" there)."""
    doc = cls.__doc__ or ""
    if doc.startswith(cls.__name__ + "("):
        return ""
    return _markdown(" ".join(inspect.cleandoc(doc).split("\n\n")[0].split()))


def yaml_value(v: object) -> str:
    """A default as it is written in a YAML file or a Hydra override."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v if re.fullmatch(r"[\w./-]+", v) else repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(yaml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(x)}" for k, x in v.items()) + "}"
    return repr(v)


def default_text(f: dataclasses.Field, path: str) -> str:
    """The default of the field at ``path``; "required" where it has none (a preset under conf/, or
    the writer of a record, supplies it)."""
    if f.default is not dataclasses.MISSING:
        return f"`{yaml_value(f.default)}`"
    if f.default_factory is not dataclasses.MISSING:
        made = f.default_factory()
        return f"see `{path}.*`" if dataclasses.is_dataclass(made) else f"`{yaml_value(made)}`"
    return "required"


def row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def type_text(f: dataclasses.Field, hint: object = None) -> str:
    """The annotation as written in the source; an enumerated setting's choices after it."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    kind = choice_type(hint)
    return f"{text}: {' | '.join(kind.values())}" if kind is not None else text


def field_table(
    cls: type, prefix: str = "", heads: tuple[str, ...] = ("setting", "type", "default", "meaning")
) -> list[str]:
    """One row per field of ``cls``: its path (``prefix`` + name), type, default and meaning."""
    meaning, hints = field_comments(cls), typing.get_type_hints(cls)
    lines = [row(list(heads)), row(["---"] * len(heads))]
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        cells = [f"`{path}`", f"`{type_text(f, hints[f.name])}`", default_text(f, path), meaning[f.name]]
        lines.append(row([cell(c) for c in cells]))
    return lines


def config_nodes(cls: type = AppConfig, path: str = "") -> list[tuple[str, type]]:
    """(Hydra path, dataclass) of every node of the tree under ``cls``, depth first."""
    out = [(path, cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, sub = hints[f.name], (f"{path}.{f.name}" if path else f.name)
        args = typing.get_args(hint)
        if typing.get_origin(hint) is tuple and args and dataclasses.is_dataclass(args[0]):
            out += config_nodes(args[0], f"{sub}[i]")
        elif dataclasses.is_dataclass(hint):
            out += config_nodes(hint, sub)
    return out


COMMAND = "python -m pipespec_mpi.analysis.reference --write"  # writes docs/config.md, outputs-fields.md
GENERATED = f"_Generated from the dataclasses and their field comments by `{COMMAND}`; do not edit by hand._"


def config_reference() -> str:
    """docs/config.md: every setting by its Hydra path, one table per node of ``AppConfig``."""
    out = [GENERATED, "", "# Configuration reference", "",
           "Every setting of a job, by the path a Hydra override or a YAML file under `conf/` names it "
           "(`decode.lookahead=4`); defaults as written in `pipespec_mpi/config/schema.py` (and "
           "`pipespec_mpi/data/config.py`), the only place they are set. \"required\": the schema has no "
           "default; a preset under `conf/` supplies it. `hierarchy.stages[i]`: each stage of the "
           "hierarchy, smallest first. How the settings are used: `docs/usage.md`."]  # fmt: skip
    for path, cls in config_nodes():
        out += ["", f"## `{path}` ({cls.__name__})" if path else f"## Top level ({cls.__name__})", ""]
        if text := heading_text(cls):
            out += [text, ""]
        out += field_table(cls, f"{path}." if path else "")
    return "\n".join(out) + "\n"
