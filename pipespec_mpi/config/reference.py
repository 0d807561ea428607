"""Markdown references read from dataclasses: names, types and defaults (``dataclasses.fields``),
meanings from each field's docstring (the string literal right below it, as torchtitan's and
vLLM's configs write them), headings from the class docstrings. ``config_reference`` renders the
configuration tree (docs/config.md); the outputs' reference (docs/outputs-fields.md) and the
command that writes both are in analysis/reference.py (records.py is in a higher layer than
config/).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from functools import cache

from pipespec_mpi.choices import choice_type
from pipespec_mpi.config.schema import AppConfig


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field of the dataclass ``cls`` -> its docstring on one line ("" where it has none)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return {f.name: _markdown(docs.get(f.name, "")) for f in dataclasses.fields(cls)}


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
    meaning, hints = field_docs(cls), typing.get_type_hints(cls)
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
GENERATED = (
    f"_Generated from the dataclasses and their field docstrings by `{COMMAND}`; do not edit by hand._"
)


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
