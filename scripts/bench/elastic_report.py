"""Results of ``scripts/bench/bench_elastic.py``: one run's outcome, a variant's summary, the tables.

Variants are duck-typed (``launcher``, ``label``, ``tuned``, ``target(scenario)``) so this module
needs nothing from the benchmark itself.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class Outcome:
    """Result of one measured run: ``ok`` with seconds, or ``hang`` / ``failed`` with a reason."""

    status: str
    seconds: Optional[float] = None
    detail: str = ""
    phases: Dict[str, float] = field(default_factory=dict)  # join: seconds from the agent's start


@dataclass
class Summary:
    """All runs of one variant in one scenario."""

    scenario: str
    variant: Any  # bench_elastic.Variant
    client: str = "bench"
    outcomes: List[Outcome] = field(default_factory=list)

    @property
    def times(self) -> List[float]:
        """Seconds of the successful runs."""
        return [o.seconds for o in self.outcomes if o.status == "ok" and o.seconds is not None]

    def median(self) -> Optional[float]:
        """Median seconds over successful runs, or None."""
        return statistics.median(self.times) if self.times else None

    def phases(self) -> Dict[str, float]:
        """Median seconds from the new agent's start to each phase (joined, round) over the runs."""
        names = sorted({k for o in self.outcomes for k in o.phases})
        return {k: statistics.median(o.phases[k] for o in self.outcomes if k in o.phases) for k in names}

    def as_dict(self) -> Dict[str, object]:
        """JSON-friendly form."""
        return {
            "scenario": self.scenario, "variant": self.variant.label, "client": self.client,
            "target_s": self.variant.target(self.scenario), "median_s": self.median(),
            "outcomes": [o.__dict__ for o in self.outcomes], "phases_median_s": self.phases(),
        }


def fmt(x: Optional[float]) -> str:
    """Seconds with one decimal, or an en dash."""
    return "–" if x is None else f"{x:.1f}"


def table(summaries: List[Summary]) -> str:
    """A markdown table: runs, median/min/max, failures and hangs, target, ratios to torchrun."""
    lines = [
        "| scenario | client | variant | runs | median s | min s | max s | failed | hung | target s (met) "
        "| ÷ torchrun default | ÷ torchrun tuned |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        ref = {
            o.variant.tuned: o.median() for o in summaries
            if o.scenario == s.scenario and o.client == s.client and o.variant.launcher == "torchrun"
        }
        med, t = s.median(), s.times
        ratios = [
            f"{med / ref[k]:.2f}×" if med is not None and ref.get(k) else "–" for k in (False, True)
        ]
        target = s.variant.target(s.scenario)
        met = f"{target:.0f} ({sum(x <= target for x in t)}/{len(s.outcomes)})" if target is not None else "–"
        failed = sum(o.status == "failed" for o in s.outcomes)
        hung = sum(o.status == "hang" for o in s.outcomes)
        lines.append(
            f"| {s.scenario} | {s.client} | {s.variant.label} | {len(s.outcomes)} | {fmt(med)} "
            f"| {fmt(min(t) if t else None)} | {fmt(max(t) if t else None)} | {failed} | {hung} | {met} "
            f"| {ratios[0]} | {ratios[1]} |"
        )
    return "\n".join(lines)


def summary_rows(summaries: List[Summary], command: str) -> List[Dict[str, Any]]:
    """The preamble's ``summary``: each elasticrun variant's median against the best torchrun's."""
    rows: List[Dict[str, Any]] = []
    for s in summaries:
        med = s.median()
        alts = [(o.median(), o.variant.label) for o in summaries if o.scenario == s.scenario
                and o.client == s.client and o.variant.launcher == "torchrun" and o.median() is not None]
        if s.variant.launcher != "elasticrun" or med is None or not alts:
            continue
        alt_value, alt = min(alts)
        rows.append({
            "metric": f"{s.scenario} -> first step ({s.client} client, {s.variant.label})", "elasticrun": med,
            "alternative": alt, "alt_value": alt_value, "unit": "s", "better": "lower",
            "ratio": alt_value / med if med > 0 else 0.0, "device": "cpu", "command": command,
        })
    return rows
