"""The package's layout, read from its imports (ast, nothing imported): layers a reader can take
top to bottom, no import cycle, a short top level (README, Layout).

A lower layer never imports a higher one, function-level and TYPE_CHECKING imports included: a
lazy import that crosses the layers upward is the same dependency, only hidden.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pipespec_mpi"

# lowest first; a group imports only from its own group and lower layers
LAYERS = [
    {"errors", "choices"},
    {"data", "topology"},
    {"config"},
    {"speculative"},
    {"stage"},
    {"host"},
    {"comm", "models", "records"},
    {"platforms"},
    {"analysis"},
    {"run"},
    {"simulate"},
    {"auto"},
    {"plan"},
    {"__main__"},
]
MAX_TOP_LEVEL = 8


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its body."""
    out: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # ``from pkg import sub`` imports the submodule, not only the package
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            out[name] |= {t for t in targets if t in mods and t != name}
    return out


def group(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer(g: str) -> int:
    return next(i for i, gs in enumerate(LAYERS) if g in gs)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []
    for root in list(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_every_group_has_a_layer():
    groups = {group(m) for m in modules()} - {""}
    unplaced = groups - set().union(*LAYERS)
    assert not unplaced, f"place these in LAYERS: {sorted(unplaced)}"


def test_no_import_goes_up_a_layer():
    bad = [
        f"{a} imports {b}"
        for a, bs in imports(modules()).items()
        for b in bs
        if group(a) and group(b) and group(a) != group(b) and layer(group(b)) >= layer(group(a))
    ]
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycle():
    assert cycles(imports(modules())) == []


def test_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_top_level_is_short():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) < MAX_TOP_LEVEL, top
