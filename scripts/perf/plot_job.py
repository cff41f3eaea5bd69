"""Draw one job: a training run's metrics log, or its agents' event logs as a timeline::

    python scripts/perf/plot_job.py metrics run.jsonl --reference ref.jsonl -o docs/img/elastic_run.png
    python scripts/perf/plot_job.py events events-*.jsonl -o timeline.png       # --print: as text

``metrics`` reads ``examples/train.py --metrics-log``; ``events`` the agents' ``--events-file`` logs
(elasticrun/launch/events.py). Drawing needs matplotlib: ``pip install 'elasticrun[plot]'``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

FIELDS = ("time", "step", "world", "lr", "global_batch", "loss", "samples_per_s", "round")
METRIC_PANELS = (("world", "world size", "steps-post"), ("lr", "learning rate", "steps-post"),
                 ("global_batch", "global batch", "steps-post"), ("loss", "loss", "default"),
                 ("samples_per_s", "samples/s", "default"))
MARKS = {"round_formed": ("o", "tab:orange"), "rescale": ("D", "tab:blue"), "restart": ("X", "tab:red"),
         "checkpoint_committed": ("|", "tab:green"), "hang": ("v", "tab:purple"), "outage_begin": ("<", "tab:gray"),
         "outage_end": (">", "tab:gray"), "job_ended": ("s", "black")}  # event kind: marker, colour
Record = Dict[str, Any]


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, imported when a chart is drawn (ImportError: matplotlib is missing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, dpi: int = 110) -> Path:
    """Write ``fig`` to the PNG ``path`` and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def read_records(paths: List[Path], flag: str, keys: Tuple[str, ...]) -> List[Record]:
    """The records of JSON-lines files, each with ``keys``; SystemExit with one line for a file that is not the file
    of ``flag`` or holds no record."""
    records: List[Record] = []
    for path in paths:
        try:
            lines = [(n, ln) for n, ln in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if ln.strip()]
        except (OSError, UnicodeDecodeError) as err:
            why = getattr(err, "strerror", None) or err
            raise SystemExit(f"plot_job: cannot read {path} ({why}); give the file of {flag}") from None
        for n, line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                raise SystemExit(f"plot_job: {path}:{n} is not JSON (give the file of {flag})") from None
            missing = [k for k in keys if not isinstance(rec, dict) or k not in rec]
            if missing:
                raise SystemExit(f"plot_job: {path}:{n} lacks {', '.join(missing)} (is it the file of {flag}?)")
            records.append(rec)
    if not records:
        raise SystemExit(f"plot_job: nothing in {', '.join(map(str, paths))} (give the file of {flag})")
    return records


def read_log(path: Path) -> List[Record]:
    """The step records of a metrics log, in step order; a step trained again after a rollback replaces the lost one."""
    by_step = {int(rec["step"]): rec for rec in read_records([path], "--metrics-log", FIELDS)}
    return [by_step[s] for s in sorted(by_step)]


def read_events(paths: List[Path]) -> List[Record]:
    """Every event of the agents' ``--events-file`` logs, in time order."""
    return sorted(read_records(paths, "--events-file", ("time", "event", "node")), key=lambda e: e["time"])


def pauses(rows: List[Record]) -> List[Tuple[float, float]]:
    """(start, end) of each time without training: from a round's last step to the next round's first."""
    return [(float(a["time"]), float(b["time"])) for a, b in zip(rows, rows[1:])
            if a["round"] != b["round"]]


def rescales(rows: List[Record]) -> List[Tuple[float, int, int]]:
    """(time, old world, new world) for every change of world size."""
    return [(float(cur["time"]), int(prev["world"]), int(cur["world"]))
            for prev, cur in zip(rows, rows[1:]) if cur["world"] != prev["world"]]


def plot_metrics(rows: List[Record], reference: Optional[List[Record]], title: str) -> Any:
    """``METRIC_PANELS`` over time, one line per round, rescales dashed, pauses shaded; the reference's loss by step."""
    t0 = float(rows[0]["time"])
    marks, gaps = rescales(rows), pauses(rows)
    fig, axes = pyplot().subplots(len(METRIC_PANELS), 1, figsize=(8, 9), sharex=True)
    for ax, (key, label, drawstyle) in zip(axes, METRIC_PANELS):
        for k, (_, group) in enumerate(itertools.groupby(rows, key=lambda r: r["round"])):
            seg = list(group)
            ax.plot([float(r["time"]) - t0 for r in seg], [float(r[key]) for r in seg], drawstyle=drawstyle,
                    color="tab:blue", lw=1.5, label="elastic run" if k == 0 else None)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        for when, old, new in marks:
            ax.axvline(when - t0, color="tab:red" if new < old else "tab:green", ls="--", lw=1)
        for i, (a, b) in enumerate(gaps):  # labelled once, on the loss panel
            ax.axvspan(a - t0, b - t0, color="0.85", lw=0,
                       label="no training (rescale/restart)" if key == "loss" and i == 0 else None)
    for when, old, new in marks:
        axes[0].annotate(f"{old}→{new}", (when - t0, new), textcoords="offset points", xytext=(3, 4), fontsize=8)
    if reference:
        step_time = {int(r["step"]): float(r["time"]) - t0 for r in rows}
        ref = [(step_time[int(r["step"])], float(r["loss"])) for r in reference if int(r["step"]) in step_time]
        if ref:
            axes[3].plot(*zip(*ref), color="black", lw=1, ls=":", label="uninterrupted run (same step)")
        axes[3].legend(fontsize=8)
    axes[3].set_yscale("log")
    axes[-1].set_xlabel("seconds since the first step")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def world_sizes(events: List[Record]) -> List[Tuple[float, int, int]]:
    """(time, round, world size) of every round, once per round (the first node to log it)."""
    first = {e["round"]: e for e in reversed(events) if e["event"] == "round_formed"}
    return sorted((e["time"], r, e["world_size"]) for r, e in first.items())


def describe(events: List[Record]) -> List[str]:
    """The timeline as text: seconds since the first event, node, event and its details."""
    t0 = events[0]["time"]
    skip = {"time", "event", "node", "job", "goodput"}
    out = []
    for e in events:
        details = " ".join(f"{k}={e[k]}" for k in sorted(e) if k not in skip)
        if e["event"] == "job_ended" and isinstance(e.get("goodput"), dict):
            details += f" goodput={e['goodput'].get('goodput_ratio')}"
        out.append(f"{e['time'] - t0:8.2f} s  {e['node']:<12} {e['event']:<21} {details}".rstrip())
    return out


def plot_events(events: List[Record], title: str) -> Any:
    """The world size of each round as a step line, one lane per node with a mark per event, outages shaded (one
    still open at the last event ends there)."""
    t0 = events[0]["time"]
    nodes = sorted({e["node"] for e in events})
    fig, (top, lanes) = pyplot().subplots(2, 1, figsize=(10, 2.2 + 0.5 * len(nodes)), sharex=True,
                                          gridspec_kw={"height_ratios": [2, max(1, len(nodes))]})
    rounds = world_sizes(events)
    if rounds:
        xs = [t - t0 for t, _, _ in rounds] + [events[-1]["time"] - t0]
        ys = [w for _, _, w in rounds] + [rounds[-1][2]]
        top.step(xs, ys, where="post", color="tab:orange")
        for t, r, w in rounds:
            top.annotate(f"r{r}", (t - t0, w), textcoords="offset points", xytext=(2, 3), fontsize=7)
        top.set_ylim(0, max(ys) + 1)
    top.set(ylabel="world size", title=title or f"job {events[0]['job']}")
    outage: Dict[str, float] = {}  # node: when its outage began
    for e in events + [{"event": "outage_end", "time": events[-1]["time"], "node": n} for n in nodes]:
        if e["event"] == "outage_begin":
            outage[e["node"]] = e["time"]
        elif e["event"] == "outage_end" and e["node"] in outage:
            lanes.axvspan(outage.pop(e["node"]) - t0, e["time"] - t0, color="0.85")
    lane = {n: i for i, n in enumerate(nodes)}
    for kind, (marker, color) in MARKS.items():
        pts = [(e["time"] - t0, lane[e["node"]]) for e in events if e["event"] == kind]
        if pts:
            lanes.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=kind, s=40)
    lanes.set_yticks(range(len(nodes)), nodes)
    lanes.set(ylim=(-0.6, len(nodes) - 0.4), xlabel="seconds since the first event")
    lanes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize=8, frameon=False)
    return fig


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Draw a job's metrics log or its agents' event logs")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("metrics", help="a metrics log (examples/train.py --metrics-log) over time")
    m.add_argument("log", type=Path, help="metrics log (examples/train.py --metrics-log)")
    m.add_argument("--reference", type=Path, help="metrics log of the uninterrupted run, drawn on the loss panel")
    e = sub.add_parser("events", help="a job's timeline from its --events-file logs")
    e.add_argument("events", type=Path, nargs="+", help="--events-file logs (one per node, or shared)")
    e.add_argument("--print", action="store_true", help="print the timeline as text instead of drawing it")
    for cmd, png in ((m, "run.png"), (e, "timeline.png")):
        cmd.add_argument("-o", "--out", type=Path, default=Path(png), help="the PNG to write")
        cmd.add_argument("--title", default="")
    args = p.parse_args(argv)
    if args.cmd == "events" and args.print:
        print("\n".join(describe(read_events(args.events))))
        return 0
    try:
        if args.cmd == "events":
            fig, what = plot_events(read_events(args.events), args.title), ""
        else:
            rows = read_log(args.log)
            fig = plot_metrics(rows, read_log(args.reference) if args.reference else None, args.title)
            paused = sum(b - a for a, b in pauses(rows))
            what = f": {len(rows)} steps, {len(rescales(rows))} rescale(s), {paused:.1f}s without training"
    except ImportError:
        raise SystemExit("plot_job: drawing needs matplotlib: pip install 'elasticrun[plot]'") from None
    print(f"wrote {save(fig, args.out, 110 if args.cmd == 'events' else 90)}{what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
