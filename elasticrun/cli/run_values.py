"""From one ``elasticrun run`` option's parsed value to the value of the config field it fills.

Every function here is a :data:`Convert`: it takes the value as the parser typed it (a ``str``,
``int``, ``float`` or ``bool``; the option's default when it was not given) and ``shown``, the
option as the user wrote it (``--restart-window 'x'``, ``PET_NNODES='x'``) for an error message,
and returns the field's value. Bad input raises :class:`~elasticrun.errors.ConfigError`, one line.
The option table (:mod:`elasticrun.cli.run_options`) names each option's conversion.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, List, Optional, Type

from elasticrun.errors import ConfigError
from elasticrun.health.thresholds import Thresholds
from elasticrun.launch.config import default_node_id
from elasticrun.rendezvous.restarts import parse_duration, parse_window
from elasticrun.sizes import RULE, parse_size

#: ``convert(value, shown) -> field value``.
Convert = Callable[[Any, str], Any]


def optional(value: Any, shown: str) -> Any:
    """The value, or None for an empty one (``--numa-binding ''``, ``--events-file ''``)."""
    return value or None


def stripped(value: Any, shown: str) -> str:
    """The text without surrounding blanks (``--event-log-handler ' console '``)."""
    return str(value).strip()


def host(value: Any, shown: str) -> str:
    """``--metrics-host``: the address, stripped; empty means the loopback address."""
    return str(value or "127.0.0.1").strip()


def node_id(value: Any, shown: str) -> str:
    """``--node-id``, or a new ``<random>@<host>:<pid>``."""
    return str(value) if value else default_node_id()


def signal_names(value: Any, shown: str) -> List[str]:
    """``--signals-to-handle sigterm,SIGUSR1`` → ``["SIGTERM", "SIGUSR1"]`` (checked by the config)."""
    return [s.strip().upper() for s in str(value).split(",") if s.strip()]


def line_filters(text: Optional[str], shown: str = "") -> List[str]:
    """torchrun's ``--duplicate-*-filters`` list: split at commas, ``,,`` a literal comma; absent: none.

    As in torchrun, an empty entry (``""``, a trailing comma) matches every line.
    """
    if text is None:
        return []
    placeholder = "\0"
    return [item.replace(placeholder, ",") for item in str(text).replace(",,", placeholder).split(",")]


def ranks_filter(value: Any, shown: str) -> Optional[List[int]]:
    """``--local-ranks-filter 2,0`` → ``[0, 2]``; empty: None (every rank)."""
    text = str(value or "").strip()
    if not text:
        return None
    try:
        ranks = sorted({int(r) for r in text.split(",")})
    except ValueError:
        raise ConfigError(f"{shown}: must be a comma-separated list of integers, e.g. "
                          "--local-ranks-filter=0,1,2") from None
    if ranks[0] < 0:
        raise ConfigError(f"{shown}: local rank {ranks[0]} must not be negative")
    return ranks


def snapshot_memory(value: Any, shown: str) -> Optional[int]:
    """``--snapshot-memory SIZE`` (or ELASTICRUN_SNAPSHOT_MEMORY) in bytes; None when not given."""
    text = str(value or "").strip()
    if not text:
        return None
    try:
        size = parse_size(text)
    except ValueError:
        raise ConfigError(f"{shown}: not a size; use {RULE} (e.g. --snapshot-memory 8GiB)") from None
    if size <= 0:
        raise ConfigError(f"{shown}: must be more than 0 (use --no-snapshots to turn memory snapshots off)")
    return size


def window(value: Any, shown: str) -> float:
    """``--restart-window 1h`` → 3600.0 (0: the whole job)."""
    return parse_window(value, shown)


def ttl(value: Any, shown: str) -> float:
    """``--ended-job-ttl 7d`` → seconds (0: forever)."""
    return parse_duration(value, shown, "to keep them forever")


def thresholds(value: Any, shown: str) -> Thresholds:
    """``--node-check-thresholds min-cpu-gflops=20,...`` over the defaults."""
    return Thresholds().parse_list(str(value or ""))


def member_of(kind: Type[enum.Enum]) -> Convert:
    """The conversion to ``kind``'s member of that value (the parser checked the choices)."""

    def convert(value: Any, shown: str) -> Any:
        return kind(value)

    convert.__doc__ = f"The {kind.__name__} of the value."
    return convert
