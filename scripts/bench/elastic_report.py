"""Results of ``bench_elastic.py``: one run's outcome, a variant's runs, the table and the JSON ``summary``."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from common import md_table, summary_row


@dataclass
class Outcome:
    """Result of one measured run: ``ok`` with seconds, or ``hang`` / ``failed`` with a reason."""

    status: str
    seconds: Optional[float] = None
    detail: str = ""
    phases: Dict[str, float] = field(default_factory=dict)  # seconds from the change to each phase


@dataclass
class Summary:
    """All runs of one variant (``bench_elastic.Variant``) and client in one scenario."""

    scenario: str
    variant: Any
    client: str = "bench"
    outcomes: List[Outcome] = field(default_factory=list)

    @property
    def times(self) -> List[float]:
        """Seconds of the successful runs."""
        return [o.seconds for o in self.outcomes if o.status == "ok" and o.seconds is not None]

    def median(self) -> Optional[float]:
        return statistics.median(self.times) if self.times else None

    def phases(self) -> Dict[str, float]:
        """Median seconds to each phase (joined, round, pause) over the runs that logged it."""
        names = sorted({k for o in self.outcomes for k in o.phases})
        return {k: statistics.median(o.phases[k] for o in self.outcomes if k in o.phases) for k in names}

    def as_dict(self) -> Dict[str, object]:
        return {"scenario": self.scenario, "variant": self.variant.label, "client": self.client,
                "target_s": self.variant.target(self.scenario), "median_s": self.median(),
                "outcomes": [o.__dict__ for o in self.outcomes], "phases_median_s": self.phases()}


def fmt(x: Optional[float]) -> str:
    """Seconds with one decimal, or an en dash."""
    return "–" if x is None else f"{x:.1f}"


def table(summaries: List[Summary]) -> str:
    """A markdown table: runs, median and range, failures and hangs, elasticrun's target, phases."""
    rows = []
    for s in summaries:
        t, target = s.times, s.variant.target(s.scenario)
        met = f"{target:.0f} ({sum(x <= target for x in t)}/{len(s.outcomes)})" if target is not None else "–"
        phases = ", ".join(f"{k} {v:.2f}" for k, v in s.phases().items())
        rows.append([s.scenario, s.client, s.variant.label, len(s.outcomes), fmt(s.median()),
                     f"{fmt(min(t) if t else None)}–{fmt(max(t) if t else None)}",
                     sum(o.status == "failed" for o in s.outcomes), sum(o.status == "hang" for o in s.outcomes), met,
                     phases])
    return md_table(["scenario", "client", "variant", "runs", "median s", "min–max s", "failed", "hung",
                     "target s (met)", "phases"], rows)


def summary_rows(summaries: List[Summary], command: str) -> List[Dict[str, Any]]:
    """The JSON ``summary``: each elasticrun variant's median against the best torchrun variant's."""
    rows: List[Dict[str, Any]] = []
    for s in summaries:
        med = s.median()
        alts = [(o.median(), o.variant.label) for o in summaries if o.scenario == s.scenario
                and o.client == s.client and o.variant.launcher == "torchrun" and o.median() is not None]
        if s.variant.launcher == "elasticrun" and med is not None and alts:
            alt_value, alt = min(alts)
            rows.append(summary_row(f"{s.scenario} -> first step ({s.client} client, {s.variant.label})", med, alt,
                                    alt_value, command=command))
    return rows
