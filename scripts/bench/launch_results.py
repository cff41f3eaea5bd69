"""Results of ``bench_launch.py``: one measured run, the markdown table and the JSON ``summary`` rows."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from common import md_table

LAUNCHERS = ["elasticrun", "torchrun-default", "torchrun-best"]
LAUNCH_MULTI = "launch-multi"
LAUNCH_SCENARIOS = ("launch", LAUNCH_MULTI)


@dataclass
class Run:
    """One measured run."""

    launcher: str
    scenario: str
    outcome: str  # ok | fail | hang
    seconds: Optional[float] = None
    note: str = ""
    crash_after: Optional[float] = None  # restart scenario: the crash's moment (s after the script started)
    phases: Dict[str, float] = field(default_factory=dict)  # elasticrun launch: milestone → s after the start
    device: str = "cpu"  # where the workers trained (cpu: gloo, cuda: NCCL)
    first_line: Optional[float] = None  # launch: s from the start to the first worker script's first line
    fork_wait: Optional[float] = None  # launch: s from the round forming to that first line (the first fork's wait)
    agent_rss_mib: Optional[float] = None  # the largest launcher (agent) process's RSS while the workers ran


# The launch scenarios' extra figures: Run field → (metric, unit), each lower-is-better against torchrun's.
LAUNCH_FIGURES = {
    "first_line": ("launch -> the script's first line", "s"),
    "fork_wait": ("round formed -> the first worker's first line (first fork's wait)", "s"),
    "agent_rss_mib": ("agent RSS while the workers run", "MiB"),
}


def label(r: Run) -> str:
    """The scenario as tables show it: ``restart@1s`` for a crash 1 s into the round."""
    return r.scenario if r.crash_after is None else f"{r.scenario}@{r.crash_after:g}s"


def _figure(runs: List[Run], name: str) -> List[float]:
    """The values of field ``name`` in the ok runs that have one (``seconds``: only non-zero ones)."""
    values = (getattr(r, name) for r in runs if r.outcome == "ok")
    return [v for v in values if v is not None and (v or name != "seconds")]


def _against_torchrun(mine: List[Run], name: str, timeout: Optional[float]) -> Optional[Dict]:
    """elasticrun's median of ``name`` against the lowest torchrun median, or None without both. With a
    ``timeout``, a torchrun with no good run counts as that (a lower bound) and says so; without, it is left out."""
    ours = _figure([r for r in mine if r.launcher == "elasticrun"], name)
    alts = []
    for launcher in dict.fromkeys(r.launcher for r in mine if r.launcher != "elasticrun"):
        theirs = [r for r in mine if r.launcher == launcher]
        good = _figure(theirs, name)
        if timeout is not None:
            note = f"{launcher} ({len(good)}/{len(theirs)} ok{'' if good else ', timeout as lower bound'})"
            alts.append((statistics.median(good) if good else timeout, note))
        elif good:
            alts.append((statistics.median(good), f"{launcher} ({len(good)} runs)"))
    if not ours or not alts:
        return None
    alt_value, alt = min(alts)
    value = statistics.median(ours)
    return {"elasticrun": value, "alternative": alt, "alt_value": alt_value, "unit": "s", "better": "lower",
            "ratio": round(alt_value / value, 3) if value else None, "runs": len(ours)}


def restart_summary(runs: List[Run], procs: int, nodes: int, timeout: float, command: str) -> List[Dict]:
    """The JSON ``summary`` rows of the restart scenario, one per crash moment: elasticrun's median against
    the better torchrun (one with no good run is given ``timeout``, a lower bound on its time, and says so)."""
    rows: List[Dict] = []
    for name in dict.fromkeys(label(r) for r in runs if r.scenario == "restart"):
        row = _against_torchrun([r for r in runs if label(r) == name], "seconds", timeout)
        if row:
            moment = "step 3" if name == "restart" else name.split("@")[1]
            rows.append({"metric": f"worker crash ({moment} into the round) -> first step, {nodes} x {procs}", **row,
                         "device": "cpu", "command": command})
    return rows


def launch_summary(runs: List[Run], procs: int, nodes: int, timeout: float, command: str,
                   devices: Optional[Dict[str, str]] = None) -> List[Dict]:
    """The JSON ``summary`` rows of the launch scenarios: elasticrun's median against the best torchrun's (one
    with no good run counts as ``timeout``) with ``delta_s`` (elasticrun minus it), then :data:`LAUNCH_FIGURES`."""
    rows: List[Dict] = []
    for scenario in LAUNCH_SCENARIOS:
        mine = [r for r in runs if r.scenario == scenario]
        shape = f"1 x {procs}, --standalone" if scenario == "launch" else f"{nodes} x {procs}, c10d"
        device = (devices or {}).get(scenario, "cpu")
        row = _against_torchrun(mine, "seconds", timeout)
        if row is None:
            continue
        rows.append({"metric": f"launch -> first step, {shape}", **row,
                     "delta_s": round(row["elasticrun"] - row["alt_value"], 3), "device": device, "command": command})
        for name, (metric, unit) in LAUNCH_FIGURES.items():
            fig = _against_torchrun(mine, name, None)
            if fig:
                fig.update(elasticrun=round(fig["elasticrun"], 3), alt_value=round(fig["alt_value"], 3), unit=unit)
                rows.append({"metric": f"{metric}, {shape}", **fig, "device": device, "command": command})
    return rows


def _median(values: List[float], fmt: str) -> str:
    return format(statistics.median(values), fmt) if values else "—"


def summarize(runs: List[Run]) -> str:
    """A markdown table: per launcher and scenario, median/min/max of good runs and the bad ones, and the
    medians of the script's first line, the first fork's wait and the agent's RSS where measured."""
    rows = []
    for scenario in dict.fromkeys(label(r) for r in runs):
        for launcher in LAUNCHERS:
            mine = [r for r in runs if r.launcher == launcher and label(r) == scenario]
            if not mine:
                continue
            good = [r.seconds for r in mine if r.outcome == "ok" and r.seconds is not None]
            stats = (
                [f"{statistics.median(good):.2f}", f"{min(good):.2f}", f"{max(good):.2f}"] if good else ["—"] * 3
            )
            counts = [str(sum(r.outcome == k for r in mine)) for k in ("ok", "fail", "hang")]
            extra = [_median(_figure(mine, "first_line"), ".2f"), _median(_figure(mine, "fork_wait"), ".3f"),
                     _median(_figure(mine, "agent_rss_mib"), ".0f")]
            rows.append([scenario, launcher, *counts, *stats, *extra])
    return md_table(["scenario", "launcher", "ok", "fail", "hang", "median s", "min s", "max s", "first line s",
                     "fork wait s", "agent RSS MiB"], rows)
