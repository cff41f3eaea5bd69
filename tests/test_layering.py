"""The package layering of docs/design.md, checked on every module's imports (no process started).

Each ``import`` of an ``elasticrun`` module, at the top of a file or inside a function, is an
edge from the importing package to the imported one; a subpackage counts as its top package
(``elasticrun.checkpoint.memory.x`` is ``checkpoint``). Imports under ``if TYPE_CHECKING:``
are edges too: an annotation that names a type of a higher layer is a dependency on it. The
test fails on an edge the table below does not allow (an upward import) and on a circle between
modules.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

pytestmark = pytest.mark.integration  # starts etcd or processes

PACKAGE = Path(__file__).resolve().parent.parent / "elasticrun"

# What each top-level package (or module) of elasticrun may import, top to bottom. Keep in step
# with the package map at the top of docs/design.md.
MAY_IMPORT: Dict[str, Set[str]] = {
    "__main__": {"cli"},
    "cli": {"launch", "rendezvous", "checkpoint", "health", "job", "store", "sizes", "errors", "proc", "waiting",
            "elasticrun"},
    "launch": {"rendezvous", "health", "job", "store", "sizes", "errors", "proc", "waiting"},
    "train": {"checkpoint", "rendezvous", "health", "job", "store", "sizes", "errors", "proc", "sockets", "waiting"},
    "rendezvous": {"health", "job", "store", "sizes", "errors", "waiting"},
    "health": {"job", "sizes", "errors", "proc", "waiting"},
    "checkpoint": {"job", "sizes", "errors", "proc", "sockets", "waiting"},
    "job": {"store", "errors"},  # store: its plain types only (EtcdSettings); no job module calls etcd
    "store": {"sizes", "errors", "proc", "waiting"},
    "errors": set(),
    "proc": set(),
    "sizes": set(),
    "sockets": set(),
    "waiting": set(),
    "elasticrun": set(),  # the package's own __init__ (__version__)
}

# What job/ may import from store/: values with no I/O.
STORE_PLAIN_TYPES: Set[str] = {"elasticrun.store.settings", "elasticrun.store.types"}

# Circles that another part of the same restructuring removes; each entry must still exist.
KNOWN_CIRCLES: Dict[Tuple[str, ...], str] = {}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _import_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every Import/ImportFrom under ``node``, ``if TYPE_CHECKING:`` bodies included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _import_nodes(child)


def _imports(name: str, path: Path, known: Set[str]) -> Set[str]:
    """The elasticrun modules that module ``name`` imports (``from pkg import sub`` is ``pkg.sub``)."""
    found: Set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "elasticrun")
            continue
        assert isinstance(node, ast.ImportFrom)
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        if base.split(".")[0] != "elasticrun":
            continue
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            found.add(sub if sub in known else base)
    found.discard(name)
    return found


@functools.cache
def _graph() -> Dict[str, Set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def test_every_import_points_down_the_layers():
    graph = _graph()
    assert "elasticrun.cli.main" in graph and "elasticrun.store.client" in graph, sorted(graph)[:5]
    upward: List[str] = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            a, b = _top(src), _top(dst)
            if a == b:
                continue
            assert a in MAY_IMPORT, f"{src}: package {a!r} has no row in MAY_IMPORT (add it, and to docs/design.md)"
            if b not in MAY_IMPORT[a]:
                upward.append(f"{src} imports {dst} ({a} may import only {sorted(MAY_IMPORT[a])})")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_contract_uses_only_plain_types_of_the_store():
    """job/ is a pure contract: from store/ it may use the plain types, never the client (no job module
    calls etcd)."""
    graph = _graph()
    calls = [f"{src} imports {dst}" for src, targets in sorted(graph.items()) if _top(src) == "job"
             for dst in sorted(targets) if _top(dst) == "store" and dst not in STORE_PLAIN_TYPES]
    assert not calls, f"job/ may import from store/ only {sorted(STORE_PLAIN_TYPES)}:\n" + "\n".join(calls)


def test_the_layer_table_has_no_circle():
    assert _cycles({a: set(b) & set(MAY_IMPORT) for a, b in MAY_IMPORT.items()}) == []


def test_no_import_circle_between_modules():
    cycles = _cycles(_graph())
    components = {tuple(sorted(set(c))) for c in cycles}
    new = [c for c in cycles if tuple(sorted(set(c))) not in KNOWN_CIRCLES]
    assert not new, "import circles:\n" + "\n".join(" -> ".join(c) for c in new)
    stale = [f"{' <-> '.join(k)} ({why})" for k, why in KNOWN_CIRCLES.items() if k not in components]
    assert not stale, "circles gone, remove from KNOWN_CIRCLES: " + "; ".join(stale)


def test_the_checks_catch_an_upward_import_and_a_circle(tmp_path):
    """The parser sees imports inside functions and under ``TYPE_CHECKING``, and the cycle finder
    finds a two-module circle."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from elasticrun.cli import main\n", encoding="utf-8")
    assert _imports("elasticrun.store.m", src, {"elasticrun.cli.main"}) == {"elasticrun.cli.main"}
    assert "cli" not in MAY_IMPORT["store"]
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from elasticrun.job.keys import JobKeys\n",
                   encoding="utf-8")
    assert _imports("elasticrun.store.m", src, {"elasticrun.job.keys"}) == {"elasticrun.job.keys"}
    assert "job" not in MAY_IMPORT["store"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b", "a"]]


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One circle per strongly connected component of more than one node (Tarjan), as a path."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_path(graph, sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path(graph: Dict[str, Set[str]], component: List[str]) -> List[str]:
    """A circle through the component's first node (breadth-first back to it)."""
    start, members = component[0], set(component)
    parents: Dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
            if w not in parents:
                parents[w] = v
                queue.append(w)
    return component
