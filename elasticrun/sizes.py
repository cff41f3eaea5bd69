"""Sizes in bytes as users write them and as messages write them: one rule for every flag and
variable that takes a size (:func:`parse_size`), one form for every size a message shows
(:func:`format_size`).

A plain integer is bytes. A number (decimals allowed) with a unit: ``K``/``M``/``G``/``T``
(``KB``/``MB``/``GB``/``TB``) are powers of 1000, ``Ki``/``Mi``/``Gi``/``Ti``
(``KiB``/``MiB``/``GiB``/``TiB``) powers of 1024; ``B`` alone is bytes; case does not matter::

    parse_size("5GB") == 5 * 10**9      parse_size("5GiB") == 5 * 2**30
    parse_size("512M") == 512 * 10**6   parse_size("1.5Gi") == 3 * 2**29

It is the rule of Hugging Face's ``max_shard_size`` and of Kubernetes quantities.
"""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(i)?)?(B)?\s*$", re.IGNORECASE)

#: How to write a size, for error messages.
RULE = "bytes, or a number with a unit: 5GB = 5·10⁹ bytes, 5GiB = 5·2³⁰ (K, M, G, T; KiB, MiB, GiB, TiB)"


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5·10⁹, ``"5GiB"`` -> 5·2³⁰, ``"1000"`` -> 1000 (see the module docstring).

    Raises ValueError with one line saying what is wrong and how to write a size."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} (use {RULE})")
    number, prefix, binary, _bytes = m.groups()
    power = " KMGT".index(prefix.upper()) if prefix else 0
    unit = (1024 if binary else 1000) ** power
    return int(number) * unit if "." not in number else int(float(number) * unit)


def format_size(n: float) -> str:
    """``n`` bytes for a message, in binary units: ``512 B``, ``1.5 KiB``, ``8.0 GiB``, ``2.0 TiB``
    (1 KiB = 1024 bytes; a negative ``n`` keeps its sign)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


__all__ = ["RULE", "format_size", "parse_size"]
