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


def restart_summary(runs: List[Run], procs: int, nodes: int, timeout: float, command: str) -> List[Dict]:
    """The JSON ``summary`` rows of the restart scenario: elasticrun's median against the better torchrun.

    A torchrun with no good run is given ``timeout`` (a lower bound on its time) and says so.
    """
    rows: List[Dict] = []
    for name in dict.fromkeys(label(r) for r in runs if r.scenario == "restart"):
        mine = [r for r in runs if label(r) == name]
        ours = [r.seconds for r in mine if r.launcher == "elasticrun" and r.outcome == "ok" and r.seconds]
        if not ours:
            continue
        alts = []
        for launcher in LAUNCHERS[1:]:
            theirs = [r for r in mine if r.launcher == launcher]
            good = [r.seconds for r in theirs if r.outcome == "ok" and r.seconds]
            if theirs:
                value = statistics.median(good) if good else timeout
                note = f"{launcher} ({len(good)}/{len(theirs)} ok{'' if good else ', timeout as lower bound'})"
                alts.append((value, note))
        if not alts:
            continue
        alt_value, alt = min(alts)
        value = statistics.median(ours)
        moment = "step 3" if name == "restart" else name.split("@")[1]
        rows.append({"metric": f"worker crash ({moment} into the round) -> first step, {nodes} x {procs}",
                     "elasticrun": value, "alternative": alt, "alt_value": alt_value, "unit": "s",
                     "better": "lower", "ratio": round(alt_value / value, 3), "device": "cpu", "command": command})
    return rows


def _figure(runs: List[Run], name: str) -> List[float]:
    return [v for v in (getattr(r, name) for r in runs if r.outcome == "ok") if v is not None]


def figure_rows(runs: List[Run], shape: str, scenario: str, command: str, device: str) -> List[Dict]:
    """Rows for :data:`LAUNCH_FIGURES`: elasticrun's median against the lowest torchrun median."""
    rows: List[Dict] = []
    mine = [r for r in runs if r.scenario == scenario]
    for name, (metric, unit) in LAUNCH_FIGURES.items():
        ours = _figure([r for r in mine if r.launcher == "elasticrun"], name)
        alts = []
        for launcher in dict.fromkeys(r.launcher for r in mine if r.launcher != "elasticrun"):
            theirs = _figure([r for r in mine if r.launcher == launcher], name)
            if theirs:
                alts.append((statistics.median(theirs), f"{launcher} ({len(theirs)} runs)"))
        if not ours or not alts:
            continue
        alt_value, alt = min(alts)
        value = statistics.median(ours)
        rows.append({"metric": f"{metric}, {shape}", "elasticrun": round(value, 3), "alternative": alt,
                     "alt_value": round(alt_value, 3), "unit": unit, "better": "lower",
                     "ratio": round(alt_value / value, 3) if value else None, "runs": len(ours), "device": device,
                     "command": command})
    return rows


def launch_summary(runs: List[Run], procs: int, nodes: int, timeout: float, command: str,
                   devices: Optional[Dict[str, str]] = None) -> List[Dict]:
    """The JSON ``summary`` rows of the launch scenarios: elasticrun's median against the best torchrun's,
    and ``delta_s`` (elasticrun minus the alternative). A torchrun with no good run counts as ``timeout``."""
    rows: List[Dict] = []
    for scenario in LAUNCH_SCENARIOS:
        mine = [r for r in runs if r.scenario == scenario]
        ours = [r.seconds for r in mine if r.launcher == "elasticrun" and r.outcome == "ok" and r.seconds]
        alts = []
        for launcher in dict.fromkeys(r.launcher for r in mine if r.launcher != "elasticrun"):
            theirs = [r for r in mine if r.launcher == launcher]
            good = [r.seconds for r in theirs if r.outcome == "ok" and r.seconds]
            note = f"{launcher} ({len(good)}/{len(theirs)} ok{'' if good else ', timeout as lower bound'})"
            alts.append((statistics.median(good) if good else timeout, note))
        if not ours or not alts:
            continue
        alt_value, alt = min(alts)
        value = statistics.median(ours)
        shape = f"1 x {procs}, --standalone" if scenario == "launch" else f"{nodes} x {procs}, c10d"
        device = (devices or {}).get(scenario, "cpu")
        rows.append({"metric": f"launch -> first step, {shape}", "elasticrun": value, "alternative": alt,
                     "alt_value": alt_value, "unit": "s", "better": "lower", "ratio": round(alt_value / value, 3),
                     "delta_s": round(value - alt_value, 3), "runs": len(ours), "device": device, "command": command})
        rows += figure_rows(runs, shape, scenario, command, device)
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
