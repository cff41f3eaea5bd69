"""Results of ``bench_launch.py``: one measured run, the markdown table and the JSON ``summary`` rows."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional

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
        rows.append({"metric": f"launch -> first step, {shape}", "elasticrun": value, "alternative": alt,
                     "alt_value": alt_value, "unit": "s", "better": "lower", "ratio": round(alt_value / value, 3),
                     "delta_s": round(value - alt_value, 3), "runs": len(ours),
                     "device": (devices or {}).get(scenario, "cpu"), "command": command})
    return rows


def summarize(runs: List[Run]) -> str:
    """A markdown table: per launcher and scenario, median/min/max of good runs and the bad ones."""
    rows = ["| scenario | launcher | ok | fail | hang | median s | min s | max s |", "|---" * 8 + "|"]
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
            rows.append("| " + " | ".join([scenario, launcher, *counts, *stats]) + " |")
    return "\n".join(rows)
