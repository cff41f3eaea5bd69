"""Checks of the numbers, sizes and durations that the typer commands (``etcd``, ``status``, ``ckpt``) take.

Each function returns a typer ``callback``: a bad value raises ``typer.BadParameter``, which
``elasticrun.cli.main`` prints as one line naming the flag (exit 2). Whole numbers use typer's
own ``min``/``max``; these cover what typer does not check: non-finite seconds (``nan``,
``inf``) and sizes written with units (``8GiB``).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import typer

from elasticrun.errors import StoreError
from elasticrun.sizes import RULE, parse_size
from elasticrun.store.types import parse_endpoints


def seconds(*, positive: bool = True) -> Callable[[Optional[float]], Optional[float]]:
    """A callback for a number of seconds: finite, and more than 0 (``positive``) or at least 0."""

    def check(value: Optional[float]) -> Optional[float]:
        if value is None:
            return None
        if not math.isfinite(value):
            raise typer.BadParameter(f"{value}: give a finite number of seconds")
        if value < 0 or (positive and value == 0):
            raise typer.BadParameter(f"{value:g}: must be more than 0 seconds" if positive else
                                     f"{value:g}: must be 0 seconds or more")
        return value

    return check


def size(*, at_least: int = 1) -> Callable[[Optional[str]], Optional[int]]:
    """A callback for a size in bytes (:mod:`elasticrun.sizes`), at least ``at_least`` bytes."""

    def check(value: Optional[str]) -> Optional[int]:
        if value is None:
            return None
        try:
            n = parse_size(value)
        except ValueError:
            raise typer.BadParameter(f"{value!r} is not a size; use {RULE}") from None
        if n < at_least:
            raise typer.BadParameter(f"{value!r}: must be at least {at_least} byte{'s' * (at_least != 1)}")
        return n

    return check


def endpoints(value: Optional[str]) -> Optional[str]:
    """A callback for etcd endpoints ``host:port[,host:port...]`` (typer names the flag, or the variable
    the value came from). An empty value is left to the command (it says what is missing)."""
    if not value:
        return value
    try:
        parse_endpoints(value)
    except StoreError:
        raise typer.BadParameter(f"{value!r}: expected host:port[,host:port...] with ports 1 .. 65535, "
                                 "e.g. etcd-host:2379") from None
    return value


__all__ = ["endpoints", "seconds", "size"]
