"""Load a file under ``scripts/`` as a module, for tests that call its functions in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS_DIR = Path(__file__).resolve().parents[2] / "scripts"


def load_script(relative: str) -> ModuleType:
    """``scripts/<relative>`` executed as a module named after its file (registered in ``sys.modules``:
    dataclasses look their module up)."""
    path = SCRIPTS_DIR / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod
