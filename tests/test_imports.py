"""No import circles in the tree: every import (module level, inside functions, under
TYPE_CHECKING) of paxengine/, serving/, kernels_pallas/ and benchmarks/ read with `ast`, and the
module graph they make has no cycle. A circle hidden behind a lazy import still couples both
modules both ways; a shared lower module breaks it instead (issue #53)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("paxengine", "serving", "kernels_pallas", "benchmarks")


def module_files() -> dict[str, Path]:
    """Module name -> file, for every .py under PACKAGES (a package is its __init__.py)."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("benchmarks", "results"):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The modules of the tree `name` imports anywhere in its file: `import a.b` names a.b;
    `from a import b` names a.b when that is a module, else a."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_pkg else name.split(".")[:-1]
                here = here[: len(here) - (node.level - 1)]
                base = ".".join(here + ([base] if base else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in mods and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = module_files()
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on, stack, out = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """Function-level, TYPE_CHECKING and relative imports are edges too (the check is blind
    otherwise)."""
    path = tmp_path / "a.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from p.b import X\n"
        "def f():\n    from . import c\n    import p\n"
    )
    mods = {"p": tmp_path, "p.a": path, "p.b": tmp_path, "p.c": tmp_path}
    assert imports_of("p.a", path, mods) == {"p", "p.b", "p.c"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50 and "paxengine.runner" in graph["paxengine.engine"]
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)
