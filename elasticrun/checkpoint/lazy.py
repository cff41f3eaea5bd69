"""Lazy package exports: a name is imported from its module on first use (most need torch)."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Mapping


def lazy_exports(package: str, table: Mapping[str, str], namespace: Dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``name`` is taken from the module ``table[name]``
    on first access and cached in ``namespace`` (the package's ``globals()``)."""

    def __getattr__(name: str) -> Any:
        if name in table:
            value = getattr(importlib.import_module(table[name]), name)
            namespace[name] = value
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__all__ = ["lazy_exports"]
