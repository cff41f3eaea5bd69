"""One row of a node check: what was checked, the figure, the threshold, and whether it passed."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional


class Verdict(str, enum.Enum):
    """A check's outcome. ``SKIP``: not applicable here (no GPU, no etcd given), never a failure."""

    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class Check:
    """One measured figure judged against its threshold."""

    name: str  # e.g. "cpu matmul", "gpu0 ecc uncorrected"
    figure: Optional[float]  # the measured value (None: could not be measured)
    unit: str  # "GFLOP/s", "MB/s", "ms", "count", ...
    threshold: str  # as shown: ">= 5", "<= 100", "== 0"
    verdict: Verdict
    detail: str = ""  # why it failed or was skipped, in words

    @property
    def failed(self) -> bool:
        return self.verdict is Verdict.FAIL

    def to_dict(self) -> Dict[str, Any]:
        return {"check": self.name, "figure": self.figure, "unit": self.unit, "threshold": self.threshold,
                "verdict": self.verdict.value, "detail": self.detail}


def at_least(name: str, figure: Optional[float], minimum: float, unit: str, detail: str = "") -> Check:
    """PASS when ``figure >= minimum``; FAIL when below or not measured."""
    if figure is None:
        return Check(name, None, unit, f">= {minimum:g}", Verdict.FAIL, detail or "could not be measured")
    ok = figure >= minimum
    return Check(name, figure, unit, f">= {minimum:g}", Verdict.PASS if ok else Verdict.FAIL,
                 "" if ok else (detail or f"{figure:.4g} {unit} is below {minimum:g}"))


def at_most(name: str, figure: Optional[float], maximum: float, unit: str, detail: str = "") -> Check:
    """PASS when ``figure <= maximum``; FAIL when above or not measured."""
    if figure is None:
        return Check(name, None, unit, f"<= {maximum:g}", Verdict.FAIL, detail or "could not be measured")
    ok = figure <= maximum
    return Check(name, figure, unit, f"<= {maximum:g}", Verdict.PASS if ok else Verdict.FAIL,
                 "" if ok else (detail or f"{figure:.4g} {unit} is above {maximum:g}"))


def skipped(name: str, why: str, unit: str = "") -> Check:
    """A check that does not apply on this node (``why`` says so)."""
    return Check(name, None, unit, "", Verdict.SKIP, why)


def failures(checks: Iterable[Check]) -> List[Check]:
    """The checks that failed."""
    return [c for c in checks if c.failed]


def summary(checks: Iterable[Check]) -> str:
    """One line naming every failed check and why ('' when none failed): a log line, a status reason."""
    return "; ".join(f"{c.name}: {c.detail}" for c in failures(checks))


__all__ = ["Check", "Verdict", "at_least", "at_most", "failures", "skipped", "summary"]
