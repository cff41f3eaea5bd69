"""Reading the benches' JSON files for scripts/perf/perf_report.py: their shapes, old and new, and the
plain data the charts (scripts/perf/perf_charts.py) are drawn from.

Every reader is lenient: a field that is missing or not a number is skipped, never raised on, so a
bench that changes its JSON shape loses a chart series at worst.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

SCENARIOS = {"restart": "worker crash", "kill": "node SIGKILL", "join": "node joins", "launch": "1 node",
             "launch-multi": "several nodes"}  # chart labels
KINDS = ("launch", "elastic", "checkpoint", "rendezvous", "snapshot")


@dataclass
class Bench:
    """One bench's JSON file, with what the manifest says about it."""

    name: str
    kind: Optional[str]
    data: Any
    command: str
    device: str


@dataclass
class Inputs:
    """Everything read from a results dir."""

    benches: List[Bench]
    manifest: Dict[str, Any]
    problems: List[str]


def num(x: Any) -> Optional[float]:
    """``x`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def kind_of(name: str, script: str = "") -> Optional[str]:
    """Which bench a file holds, from the manifest's script name or the file name."""
    for src in (Path(script).stem.replace("bench_", ""), name.split("-")[0].split(".")[0]):
        if src in KINDS:
            return src
    return None


def records(data: Any, keys: Iterable[str] = ("runs", "results", "rows", "summaries", "variants")) -> List[dict]:
    """The list of per-run dicts of a bench JSON: the JSON itself, or the first such list inside it."""
    if isinstance(data, list):
        return [r for r in data if isinstance(r, dict)]
    if isinstance(data, dict):
        for k in [*keys, *data.keys()]:
            v = data.get(k)
            if k != "summary" and isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
                return v
    return []


def median_or_none(xs: List[float]) -> Optional[float]:
    """The median, or None for no values."""
    return statistics.median(xs) if xs else None


def launch_groups(data: Any) -> Dict[Tuple[str, str], Tuple[List[float], int]]:
    """(scenario, launcher) → (seconds of the ok runs, number of runs)."""
    out: Dict[Tuple[str, str], Tuple[List[float], int]] = {}
    for r in records(data):
        at = num(r.get("crash_after"))  # a crash at a set moment of the round: its own group
        key = (str(r.get("scenario", "?")) + (f"@{at:g}s" if at is not None else ""), str(r.get("launcher", "?")))
        times, n = out.get(key, ([], 0))
        t = num(r.get("seconds"))
        if r.get("outcome", "ok") == "ok" and t is not None:
            times.append(t)
        out[key] = (times, n + 1)
    return out


def elastic_groups(data: Any) -> Dict[Tuple[str, str], Tuple[List[float], int]]:
    """(scenario, variant) → (seconds of the ok runs, number of runs)."""
    out: Dict[Tuple[str, str], Tuple[List[float], int]] = {}
    for s in records(data, ("summaries", "variants", "results", "runs")):
        outs = [o for o in s.get("outcomes", []) if isinstance(o, dict)]
        times = [t for o in outs if o.get("status") == "ok" for t in [num(o.get("seconds"))] if t is not None]
        who = str(s.get("variant", "?")) + (f" · {s['client']} client" if s.get("client") else "")
        out[(str(s.get("scenario", "?")), who)] = (times, len(outs))
    return out


def checkpoint_series(data: Any) -> Dict[str, float]:
    """Label → median seconds of a checkpoint bench JSON (``runs``: label → list of seconds)."""
    runs = data.get("runs") if isinstance(data, dict) else None
    out = {}
    for label, ts in (runs.items() if isinstance(runs, dict) else []):
        vals = [v for v in (ts if isinstance(ts, list) else [ts]) for v in [num(v)] if v is not None]
        if vals:
            out[str(label)] = statistics.median(vals)
    return out


def ckpt_op(label: str) -> Tuple[str, str]:
    """(tool, op) of a checkpoint row label; op is save, load, load-into, or '' for the rest."""
    low = label.lower()
    tool = next((t for t in ("elasticrun", "safetensors", "dcp", "torch", "disk") if t in low), "other")
    tool = {"dcp": "DCP", "torch": "torch.save/load"}.get(tool, tool)
    if any(w in low for w in ("async", "replicated", "2 ranks", "io_threads", "verify=false", "failed")):
        return tool, ""
    last = low.replace("(ceiling)", "").split()[-1] if low.split() else ""
    if "into state_dict" in low or "into existing" in low or "in place" in low:
        return tool, "load-into"
    if "write" in low or last == "save" or ("save" in low and "load" not in low):
        return tool, "save"
    if "read" in low or "load" in low:
        return tool, "load"
    return tool, ""


def rendezvous_points(data: Any) -> Dict[int, float]:
    """Nodes → median seconds until every agent holds round 0."""
    by: Dict[int, List[float]] = {}
    for r in records(data):
        n, t = num(r.get("nodes")), num(r.get("all_round_s"))
        if n is not None and t is not None:
            by.setdefault(int(n), []).append(t)
    return {n: statistics.median(ts) for n, ts in sorted(by.items())}


def scenario_label(scenario: str) -> str:
    """A chart label for a scenario key: ``restart@1s`` → ``worker crash at 1s``."""
    base, _, at = scenario.partition("@")
    return SCENARIOS.get(base, base) + (f" at {at}" if at else "")


def _phases(data: Any, scenario: str, launcher: str) -> List[Tuple[str, float]]:
    """Phase marks (name, seconds since the clock started) of the median ok run of a group, when runs
    carry a ``phases`` dict; empty otherwise."""
    scenario = scenario.split("@")[0]
    runs = [r for r in records(data) if r.get("scenario") == scenario and r.get("launcher") == launcher
            and r.get("outcome", "ok") == "ok" and isinstance(r.get("phases"), dict) and num(r.get("seconds"))]
    if not runs:
        return []
    runs.sort(key=lambda r: r["seconds"])
    mid = runs[len(runs) // 2]["phases"]
    return sorted(((str(k), float(v)) for k, v in mid.items() if num(v) is not None), key=lambda kv: kv[1])


def chart_data(inputs: Inputs) -> Dict[str, Any]:
    """Plain data for scripts/perf/perf_charts.py: launch, recovery and scale-up distributions, checkpoint
    throughput against size, rendezvous time against nodes."""
    recovery: List[Dict[str, Any]] = []
    launch: List[Dict[str, Any]] = []
    scaleup: List[Dict[str, Any]] = []
    points: List[Tuple[str, str, str, Tuple[float, float]]] = []  # (op, series, tag, (GB, GB/s))
    rdzv: Dict[str, Dict[int, float]] = {}
    for b in inputs.benches:
        if b.kind == "launch":
            for (sc, who), (times, n) in launch_groups(b.data).items():
                item = {"label": f"{who} · {scenario_label(sc)}", "times": times, "runs": n,
                        "phases": _phases(b.data, sc, who)}
                (launch if sc.startswith("launch") else recovery).append(item)  # launch, launch-multi: starts
        elif b.kind == "elastic":
            run = "" if b.name == b.kind else f" ({b.name})"  # e.g. elastic-join3: another job shape
            for (sc, who), (times, n) in elastic_groups(b.data).items():
                item = {"label": f"{who} · {scenario_label(sc)}{run}", "times": times, "runs": n, "phases": []}
                (scaleup if sc == "join" else recovery).append(item)
        elif b.kind == "checkpoint" and isinstance(b.data, dict):
            src, tag = checkpoint_source(b.data)
            if not num(src.get("size_bytes")):
                continue
            size = float(src["size_bytes"]) / 1e9
            for label, sec in checkpoint_series(src).items():
                tool, op = ckpt_op(label)
                if op and sec > 0:
                    op = "load" if op == "load-into" else op
                    name = _short(label) if tool in ("elasticrun", "disk") else tool
                    points.append((op, name, tag, (size, size / sec)))
        elif b.kind == "rendezvous":
            for key, rows in _rdzv_series(b).items():
                rdzv[key] = rendezvous_points(rows)
    tags = {tag for _, _, tag, _ in points}
    ckpt: Dict[str, Dict[str, List[Tuple[float, float]]]] = {}
    for op, name, tag, pt in points:  # a state/device tag only where the files differ in it
        ckpt.setdefault(op, {}).setdefault(name + (tag if len(tags) > 1 else ""), []).append(pt)
    return {"recovery": recovery, "launch": launch, "scaleup": scaleup, "checkpoint": ckpt, "rendezvous": rdzv,
            "device": str(inputs.manifest.get("device") or "cpu"),
            "checkpoint_note": next(iter(tags)).strip(" []") if len(tags) == 1 else ""}


def checkpoint_source(data: Dict[str, Any]) -> Tuple[Dict[str, Any], str]:
    """The part of a checkpoint JSON to chart: its interleaved ``compare`` section when it has one
    (with a legend tag for a non-uniform state or a GPU), else the whole document (older shape)."""
    comp = data.get("compare")
    if isinstance(comp, dict) and isinstance(comp.get("runs"), dict) and comp["runs"]:
        tags = [str(comp[k]) for k in ("state", "device") if comp.get(k) not in (None, "uniform", "cpu")]
        return comp, f" [{', '.join(tags)}]" if tags else ""
    return data, ""


def _short(label: str) -> str:
    """A checkpoint row label as a legend entry."""
    for long, short in (("save / load save", "save"), ("save / load load", "load, fresh tensors"),
                        ("load into state_dict", "load into existing tensors"), ("sequential write + fsync", "write"),
                        ("cold sequential read", "cold read"), (" (durable)", ""), (" (cold)", ""),
                        (" (dd, fresh file)", "")):
        label = label.replace(long, short)
    return label


def _rdzv_series(b: Bench) -> Dict[str, List[dict]]:
    """A rendezvous file's rows grouped by implementation (a ``launcher``/``impl``/``clients`` field),
    or all under the file's name."""
    out: Dict[str, List[dict]] = {}
    for r in records(b.data):
        tag = next((str(r[k]) for k in ("launcher", "impl", "tool", "clients") if k in r), "")
        base = "elasticrun" if b.name == "rendezvous" else f"elasticrun ({b.name.replace('rendezvous-', '')})"
        out.setdefault(f"{base}, {tag}" if tag else base, []).append(r)
    return out

