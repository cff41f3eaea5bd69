"""The rendezvous's decision modules do no I/O: they import no etcd client, no process, socket, thread or
clock module, directly or through another elasticrun module (imports under ``if TYPE_CHECKING:`` are
annotations only). Their callers gather what they decide on and carry the decisions out."""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import FrozenSet, Set

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "elasticrun"
DECISIONS = ("rendezvous.plan", "rendezvous.roundend", "rendezvous.inplace", "rendezvous.ranks",
             "rendezvous.restarts")
IO_MODULES = {"time", "threading", "subprocess", "socket", "os", "select", "signal", "grpc", "pyetcd"}


@functools.cache
def _imports(module: str) -> FrozenSet[str]:
    """What ``elasticrun.<module>`` imports at run time (TYPE_CHECKING blocks left out)."""
    tree = ast.parse((PACKAGE / (module.replace(".", "/") + ".py")).read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
               for n in ast.walk(node)}
    found: Set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return frozenset(found)


def _closure(module: str) -> Set[str]:
    """Every elasticrun module ``module`` reaches at run time, and itself."""
    seen, todo = set(), [module]
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        todo += [m[len("elasticrun."):] for m in _imports(mod) if m.startswith("elasticrun.")
                 and (PACKAGE / (m[len("elasticrun."):].replace(".", "/") + ".py")).exists()]
    return seen


@pytest.mark.parametrize("module", DECISIONS)
def test_a_decision_module_imports_no_io(module):
    direct = {m.split(".")[0] for m in _imports(module)}
    assert not direct & IO_MODULES, f"{module} imports {sorted(direct & IO_MODULES)}"
    reached = _closure(module)
    assert not [m for m in reached if m.startswith("store")], f"{module} reaches the etcd client: {sorted(reached)}"
