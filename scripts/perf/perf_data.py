"""Reading a benchmark run for scripts/perf/perf_report.py: the bench JSON files of a ``run_all.py`` output dir,
and the plain data the charts (perf_charts.py) are drawn from, out of each bench's raw results as the benches
of this tree write them (their ``summary`` rows are checked where the table is made).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

MANIFEST = "bench_all.json"
KINDS = ("launch", "elastic", "checkpoint", "rendezvous", "snapshot")
SCENARIOS = {"restart": "worker crash", "kill": "node SIGKILL", "join": "node joins", "leave": "node leaves",
             "launch": "1 node", "launch-multi": "several nodes"}  # chart labels
CKPT_OPS = ((" save (durable)", "save"), (" load into existing tensors (cold)", "load"))  # ckpt_compare's labels


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


def _manifest(d: Path, problems: List[str]) -> Tuple[Dict[str, Any], Dict[str, Dict[str, Any]]]:
    """The run's manifest and its entries by JSON file name; a bench that failed goes to ``problems``."""
    manifest: Dict[str, Any] = {}
    if (d / MANIFEST).exists():
        try:
            manifest = json.loads((d / MANIFEST).read_text())
        except ValueError as e:
            problems.append(f"{MANIFEST}: not JSON ({e})")
    entries = {str(e.get("json") or f"{e.get('name')}.json"): e for e in manifest.get("benches", [])
               if isinstance(e, dict)}
    for e in entries.values():
        if e.get("status") not in (None, "ok"):
            problems.append(f"{e.get('name')}: {e.get('status')} "
                            f"({'; '.join(e.get('notes') or []) or 'exit code ' + str(e.get('returncode'))})")
    return manifest, entries


def load_dir(d: Path) -> Inputs:
    """Read the manifest and the bench JSON files it lists (every ``*.json`` of a dir without one); problems
    are collected, not raised."""
    problems: List[str] = []
    manifest, entries = _manifest(d, problems)
    listed = [d / str(e["json"]) for e in entries.values() if e.get("json")]
    problems += [f"{p.name}: listed in {MANIFEST} but missing" for p in listed if not p.exists()]
    files = [p for p in listed if p.exists()] if "benches" in manifest else sorted(d.glob("*.json"))
    benches: List[Bench] = []
    for p in (p for p in files if p.name != MANIFEST):  # with a manifest, older files in the dir are not read
        e = entries.get(p.name, {})
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as err:
            problems.append(f"{p.name}: unreadable ({err.__class__.__name__})")
            continue
        dev = data.get("device") if isinstance(data, dict) and isinstance(data.get("device"), str) else None
        benches.append(Bench(p.stem, kind_of(p.stem, str(e.get("script", ""))), data, str(e.get("command") or ""),
                             dev or str(manifest.get("device") or "cpu")))
    return Inputs(benches, manifest, problems)


def scenario_label(scenario: str) -> str:
    """A chart label for a scenario key: ``restart@1s`` → ``worker crash at 1s``."""
    base, _, at = scenario.partition("@")
    return SCENARIOS.get(base, base) + (f" at {at}" if at else "")


def launch_items(data: Dict[str, Any]) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """(scenario, chart item) per scenario and launcher of bench_launch.py's ``runs``; a crash at a set moment
    of the round is a scenario of its own. Phase marks are the median ok run's."""
    groups: Dict[Tuple[str, str], List[dict]] = {}
    for r in data["runs"]:
        at = r.get("crash_after")
        groups.setdefault((r["scenario"] + (f"@{at:g}s" if at is not None else ""), r["launcher"]), []).append(r)
    for (scenario, who), runs in groups.items():
        ok = sorted((r for r in runs if r["outcome"] == "ok"), key=lambda r: r["seconds"])
        phases = ok[len(ok) // 2].get("phases") if ok else None
        marks = sorted((phases or {}).items(), key=lambda kv: kv[1])
        yield scenario, {"label": f"{who} · {scenario_label(scenario)}", "times": [r["seconds"] for r in ok],
                         "runs": len(runs), "phases": marks}


def elastic_items(b: Bench) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """(scenario, chart item) per scenario, variant and client of bench_elastic.py's ``results``."""
    run = "" if b.name == b.kind else f" ({b.name})"  # e.g. elastic-join3: another job shape
    for s in b.data["results"]:
        times = [o["seconds"] for o in s["outcomes"] if o["status"] == "ok"]
        yield s["scenario"], {"label": f"{s['variant']} · {s['client']} client · "
                                       f"{scenario_label(s['scenario'])}{run}",
                              "times": times, "runs": len(s["outcomes"]), "phases": []}


def checkpoint_points(data: Dict[str, Any]) -> Iterator[Tuple[str, str, str, Tuple[float, float]]]:
    """(op, tool, tag, (GB, GB/s)) of bench_checkpoint.py's ``compare`` section: each library's durable save
    and cold load into existing tensors, and the disk's cold read; the tag names a non-uniform state or a GPU."""
    comp = data["compare"]
    size = comp["size_bytes"] / 1e9
    tags = [str(comp[k]) for k in ("state", "device") if comp[k] not in ("uniform", "cpu")]
    tag = f" [{', '.join(tags)}]" if tags else ""
    for label, secs in comp["runs"].items():
        found = [(op, label[: -len(suffix)]) for suffix, op in CKPT_OPS if label.endswith(suffix)]
        if label.startswith("disk: cold"):
            found = [("load", "disk: cold read")]
        if found and secs and "verify=False" not in label:
            yield found[0][0], found[0][1], tag, (size, size / statistics.median(secs))


def chart_data(inputs: Inputs) -> Dict[str, Any]:
    """Plain data for perf_charts.py: launch, recovery and scale-up distributions, checkpoint throughput against
    size, and each rendezvous bench's rows."""
    out: Dict[str, Any] = {"recovery": [], "launch": [], "scaleup": [], "checkpoint": {}, "rendezvous": {},
                           "device": str(inputs.manifest.get("device") or "cpu")}
    points: List[Tuple[str, str, str, Tuple[float, float]]] = []
    for b in inputs.benches:
        if b.kind == "launch":
            for scenario, item in launch_items(b.data):
                out["launch" if scenario.startswith("launch") else "recovery"].append(item)
        elif b.kind == "elastic":
            for scenario, item in elastic_items(b):
                out["scaleup" if scenario == "join" else "recovery"].append(item)
        elif b.kind == "checkpoint":
            points += checkpoint_points(b.data)
        elif b.kind == "rendezvous" and b.data["rows"]:
            out["rendezvous"][b.name] = b.data
    tags = {tag for _, _, tag, _ in points}
    for op, tool, tag, pt in points:  # a state/device tag only where the files differ in it
        out["checkpoint"].setdefault(op, {}).setdefault(tool + (tag if len(tags) > 1 else ""), []).append(pt)
    out["checkpoint_note"] = next(iter(tags)).strip(" []") if len(tags) == 1 else ""
    return out
