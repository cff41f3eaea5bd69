"""The agent's side of elasticrun imports no torch: every module an agent (or the bare fork server)
can load, imported in a fresh interpreter, leaves ``torch`` out of ``sys.modules``.

The agent's packages are ``cli``, ``launch``, ``rendezvous``, ``store``, ``job`` and the top-level
modules; ``checkpoint`` and ``train`` are the workers' (they import torch, and the CLI loads them
only inside the ``ckpt`` commands). A running agent's memory map is checked in test_launch_c10d.py;
this test names the module that pulled torch in, for every module, including code paths that job
never reaches.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator, List

import pytest

pytestmark = pytest.mark.integration  # starts etcd or processes

PACKAGE = Path(__file__).resolve().parent.parent / "elasticrun"
AGENT_PACKAGES = ("cli", "launch", "rendezvous", "store", "job")

# Imports every agent-side module in turn, in one interpreter, and names the first one after whose
# import torch (or any torch.* module) is loaded.
PROBE = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    import elasticrun
    names = sorted(m.name for m in pkgutil.iter_modules(elasticrun.__path__, "elasticrun.") if not m.ispkg)
    for package in PACKAGES:
        pkg = importlib.import_module("elasticrun." + package)
        names.append(pkg.__name__)
        names += sorted(m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."))
    culprit = None
    for name in names:
        importlib.import_module(name)
        if any(m == "torch" or m.startswith("torch.") for m in sys.modules):
            culprit = name
            break
    print(json.dumps({"imported": names, "culprit": culprit}))
""")


def test_no_agent_side_module_imports_torch() -> None:
    code = f"PACKAGES = {AGENT_PACKAGES!r}\n" + PROBE
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["culprit"] is None, f"importing {result['culprit']} loads torch into the agent"
    imported = set(result["imported"])
    # The probe really walked the agent's code: the modules a launch runs through are among them.
    for name in ("elasticrun.cli.main", "elasticrun.launch.agent", "elasticrun.launch.workers",
                 "elasticrun.launch.c10d", "elasticrun.launch.gpus", "elasticrun.launch.zygote",
                 "elasticrun.rendezvous.storehost"):
        assert name in imported, name


# Agent-side modules whose torch imports run in another process: the store host's entry point and
# the standby/fork server's preload. Anywhere else, an ``import torch`` (top-level or in a function)
# would run in the agent.
RUNS_ELSEWHERE = {
    "launch/storeserver.py": "the store host process (python -m elasticrun.launch.storeserver, or a fork server child)",
    "launch/warm.py": "the standby interpreters and the fork server's preload",
}


def _torch_imports(path: Path) -> Iterator[int]:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            yield node.lineno
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            yield node.lineno


def test_no_agent_side_code_imports_torch_even_inside_a_function() -> None:
    """The probe above sees import time only; an import inside a function would load torch into the
    agent when that path runs. Only the modules that run in other processes may import it."""
    found: List[str] = []
    files = sorted(PACKAGE.glob("*.py"))
    for package in AGENT_PACKAGES:
        files += sorted((PACKAGE / package).rglob("*.py"))
    for path in files:
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in RUNS_ELSEWHERE:
            continue
        found += [f"elasticrun/{relative}:{line}" for line in _torch_imports(path)]
    assert found == [], "torch imported in the agent's code: " + ", ".join(found)
    # The scan does find torch imports where they are: the exceptions above have them.
    for relative in RUNS_ELSEWHERE:
        assert list(_torch_imports(PACKAGE / relative)), relative
