"""The job's restart budget: ``--max-restarts N`` over the whole job, or within a window.

Only worker failures use up a restart (a node joining, leaving or dying is a membership
change and never counts). Without a window the budget is torchrun's: N restarts for the
job's whole life. With ``--restart-window 1h`` it is a long-running service's: at most N
restarts in *any* hour, so a weeks-long job with a crash now and then never runs out,
while a crash loop still ends the job after N quick restarts.

The budget is job-wide: the restart times live in etcd (``JobKeys.restarts``), written
in the same transaction as the round the restart forms, so every agent sees the same
history. Times are the writing agent's wall clock (``time.time()``); the window is meant
to be minutes to days, far above any sane clock skew between nodes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, List, Optional

from elasticrun.errors import ConfigError

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE)


def parse_duration(text: Optional[str], shown: str, zero: str) -> float:
    """``"1h"`` → 3600.0, ``"90m"``, ``"30s"``, ``"2d"``, ``"600"`` (seconds); ``""``/``"0"`` → 0 (what
    ``zero`` says it means). Raises :class:`ConfigError` naming ``shown`` (the option and its value as
    written, e.g. ``--restart-window '1x'``)."""
    if text is None or str(text).strip() in ("", "0"):
        return 0.0
    m = _DURATION.match(str(text))
    if not m:
        raise ConfigError(f"{shown}: give a duration like 1h, 30m, 90s or 2d (or 0 {zero})")
    return float(m[1]) * _UNITS[m[2].lower()]


def parse_window(text: Optional[str], shown: str = "") -> float:
    """``--restart-window``: a duration (:func:`parse_duration`); 0: the budget is for the whole job."""
    return parse_duration(text, shown or f"--restart-window {text!r}", "for the whole job")


def format_window(seconds: float) -> str:
    """3600 → ``"1h"``; 90 → ``"90s"``."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


@dataclass(frozen=True)
class RestartBudget:
    """``max_restarts`` restarts, counted over the job (``window`` 0) or any ``window`` seconds."""

    max_restarts: int
    window: float = 0.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: must be 0 or more")
        if self.window < 0:
            raise ConfigError(f"--restart-window {self.window}: must not be negative")

    def recent(self, history: Iterable[float], now: float) -> List[float]:
        """The restart times that still count at ``now`` (all of them without a window)."""
        times = sorted(float(t) for t in history)
        if not self.window:
            return times
        return [t for t in times if now - t < self.window]

    def used(self, restart_count: int, history: Iterable[float], now: float) -> int:
        """Restarts that count against the budget now. Without a window that is the job's
        ``restart_count``; with one, the restarts recorded within the last ``window`` s."""
        return len(self.recent(history, now)) if self.window else restart_count

    def allows(self, restart_count: int, history: Iterable[float], now: float) -> bool:
        """True when one more restart fits in the budget."""
        return self.used(restart_count, history, now) < self.max_restarts

    def record(self, history: Iterable[float], now: float) -> List[float]:
        """The history to store after a restart at ``now``: recent times only (bounded size)."""
        kept = self.recent(history, now) if self.window else sorted(float(t) for t in history)[-self.max_restarts:]
        return [*kept, float(now)][-max(1, self.max_restarts + 1):]

    def describe(self) -> str:
        """``"3 restart(s)"`` or ``"3 restart(s) within 1h"`` for messages."""
        scope = f" within {format_window(self.window)}" if self.window else ""
        return f"{self.max_restarts} restart(s){scope}"


__all__ = ["RestartBudget", "format_window", "parse_duration", "parse_window"]
