"""Enumerated settings: each choice is a ``StrEnum`` whose members are named as their values (so
Hydra takes ``transport.kind=gloo`` by name and rejects anything else while it composes), equal to
plain strings wherever the code compares them; ``problems`` checks a config built in Python."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing


class Choice(enum.StrEnum):
    """A setting's allowed values; ``str(member)`` and f-strings give the value."""

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(m.value for m in cls)


def choice_type(hint: object) -> type[Choice] | None:
    """The ``Choice`` a field's type holds: itself, ``X | None`` or ``tuple[X, ...]``."""
    if isinstance(hint, type) and issubclass(hint, Choice):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType, tuple):
        for arg in typing.get_args(hint):
            if (found := choice_type(arg)) is not None:
                return found
    return None


def problems(node: object, path: str = "") -> list[str]:
    """Every enumerated value of a config tree (dataclasses, tuples of them) outside its choices."""
    if not dataclasses.is_dataclass(node):
        return []
    out: list[str] = []
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value, where = getattr(node, f.name), f"{path}.{f.name}" if path else f.name
        items = value if isinstance(value, (tuple, list)) else (value,)
        kind = choice_type(hints[f.name])
        if kind is not None:
            allowed = kind.values()
            bad = [v for v in items if v is not None and v not in allowed]
            out += [f"{where}={v!r}: must be one of {', '.join(allowed)}" for v in map(str, bad)]
            continue
        for i, item in enumerate(items):
            out += problems(item, f"{where}[{i}]" if item is not value else where)
    return out
