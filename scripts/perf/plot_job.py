"""Draw one job: its training metrics log, its agents' event logs (JSON lines), or its agents' /metrics::

    python scripts/perf/plot_job.py metrics run.jsonl --reference ref.jsonl -o docs/img/elastic_run.png
    python scripts/perf/plot_job.py events events-*.jsonl -o timeline.png       # --print: as text
    python scripts/perf/plot_job.py scrape 127.0.0.1:9400 127.0.0.1:9401 -o scrapes.jsonl --every 0.5
    python scripts/perf/plot_job.py dashboard scrapes.jsonl -o docs/img/observability.png

``metrics`` reads ``examples/train.py --metrics-log``; ``events`` the agents' ``--events-file`` logs
(elasticrun/launch/events.py). ``scrape`` appends ``{"time", "target", "samples": [[name, {labels}, value], ...]}``
per answered scrape; ``dashboard`` draws deploy/grafana/elasticrun.json's panels from those lines, each panel's
PromQL (docs/observability.md) evaluated by hand: sums and maxima across the agents at each scrape time,
``rate``/``deriv`` as differences over ``--window`` seconds, ``histogram_quantile`` interpolated within the bucket
as Prometheus does. Drawing needs matplotlib: ``pip install 'elasticrun[plot]'``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

FIELDS = ("time", "step", "world", "lr", "global_batch", "loss", "samples_per_s")
METRIC_PANELS = (("world", "world size", "steps-post"), ("lr", "learning rate", "steps-post"),
                 ("global_batch", "global batch", "steps-post"), ("loss", "loss", "default"),
                 ("samples_per_s", "samples/s", "default"))
MARKS = {"round_formed": ("o", "tab:orange"), "rescale": ("D", "tab:blue"), "restart": ("X", "tab:red"),
         "checkpoint_committed": ("|", "tab:green"), "hang": ("v", "tab:purple"), "outage_begin": ("<", "tab:gray"),
         "outage_end": (">", "tab:gray"), "job_ended": ("s", "black")}  # event kind: marker, colour
Record = Dict[str, Any]
Points = List[Tuple[float, float]]
Series = Dict[str, Points]


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; SystemExit with what to install when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot_job: drawing needs matplotlib: pip install 'elasticrun[plot]'") from None
    return plt


def save(fig: Any, out: Path, dpi: int) -> None:
    """Lay ``fig`` out, write it to ``out`` and free it."""
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    pyplot().close(fig)


def json_lines(path: Path, flag: str) -> Iterator[Tuple[int, Any]]:
    """(line number, record) of a JSON-lines file; SystemExit with one line for a file that is not one."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        why = getattr(err, "strerror", None) or err
        raise SystemExit(f"plot_job: cannot read {path} ({why}); give the file of {flag}") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except ValueError:
                raise SystemExit(f"plot_job: {path}:{n} is not JSON (give the file of {flag})") from None


def read_log(path: Path) -> List[Record]:
    """The step records of a metrics log, in step order; the last record of a step wins (a step
    trained again after a rollback replaces the one that was lost)."""
    by_step: Dict[int, Record] = {}
    for n, rec in json_lines(path, "--metrics-log"):
        missing = [k for k in FIELDS if not isinstance(rec, dict) or k not in rec]
        if missing:
            raise SystemExit(f"plot_job: {path}:{n} lacks {', '.join(missing)} (is it a --metrics-log file?)")
        by_step[int(rec["step"])] = rec
    if not by_step:
        raise SystemExit(f"plot_job: {path} holds no steps")
    return [by_step[s] for s in sorted(by_step)]


def read_events(paths: List[Path]) -> List[Record]:
    """Every event of ``paths``, in time order; SystemExit with one line for a file that is not an events log."""
    events: List[Record] = []
    for path in paths:
        for n, rec in json_lines(path, "--events-file"):
            if not isinstance(rec, dict) or not {"time", "event", "node"} <= set(rec):
                raise SystemExit(f"plot_job: {path}:{n} lacks time/event/node (is it an --events-file log?)")
            events.append(rec)
    if not events:
        raise SystemExit("plot_job: no events in " + ", ".join(map(str, paths)))
    return sorted(events, key=lambda e: e["time"])


def pauses(rows: List[Record]) -> List[Tuple[float, float]]:
    """(start, end) times when no step was trained: between the last step of a round and the first
    step of the next one (the rescale or restart: stop, rendezvous, worker start, resume)."""
    return [(float(a["time"]), float(b["time"])) for a, b in zip(rows, rows[1:])
            if a.get("round") != b.get("round")]


def rescales(rows: List[Record]) -> List[Tuple[float, int, int]]:
    """(time, old world, new world) for every change of world size."""
    return [(float(cur["time"]), int(prev["world"]), int(cur["world"]))
            for prev, cur in zip(rows, rows[1:]) if cur["world"] != prev["world"]]


def plot_metrics(rows: List[Record], out: Path, reference: Optional[List[Record]] = None, title: str = "") -> None:
    """World size, LR, global batch, loss and samples/s over time, one line per round; rescales as dashed lines,
    pauses shaded; the reference run's loss by step number."""
    plt = pyplot()
    t0 = float(rows[0]["time"])
    marks, gaps = rescales(rows), pauses(rows)
    fig, axes = plt.subplots(len(METRIC_PANELS), 1, figsize=(8, 9), sharex=True)
    for ax, (key, label, drawstyle) in zip(axes, METRIC_PANELS):
        for k, (_, group) in enumerate(itertools.groupby(rows, key=lambda r: r.get("round"))):
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
            axes[3].plot([a for a, _ in ref], [b for _, b in ref], color="black", lw=1, ls=":",
                         label="uninterrupted run (same step)")
        axes[3].legend(fontsize=8)
    axes[3].set_yscale("log")
    axes[-1].set_xlabel("seconds since the first step")
    if title:
        fig.suptitle(title, fontsize=10)
    save(fig, out, 90)


def world_sizes(events: List[Record]) -> List[Tuple[float, int, int]]:
    """(time, round, world size) of every round, once per round (the first node to log it)."""
    seen: Dict[int, Tuple[float, int, int]] = {}
    for e in events:
        if e["event"] == "round_formed" and e.get("round") not in seen:
            seen[e["round"]] = (e["time"], e["round"], int(e.get("world_size", 0)))
    return sorted(seen.values())


def outages(events: List[Record]) -> List[Tuple[float, float]]:
    """(begin, end) of every outage; one still open at the last event ends there."""
    open_: Dict[str, float] = {}
    spans = []
    for e in events:
        if e["event"] == "outage_begin":
            open_[e["node"]] = e["time"]
        elif e["event"] == "outage_end" and e["node"] in open_:
            spans.append((open_.pop(e["node"]), e["time"]))
    return spans + [(begin, events[-1]["time"]) for begin in open_.values()]


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


def plot_events(events: List[Record], out: Path, title: str = "") -> None:
    """The world size of each round as a step line, one lane per node with a mark per event, outages shaded."""
    plt = pyplot()
    t0 = events[0]["time"]
    nodes = sorted({e["node"] for e in events})
    fig, (top, lanes) = plt.subplots(2, 1, figsize=(10, 2.2 + 0.5 * len(nodes)), sharex=True,
                                     gridspec_kw={"height_ratios": [2, max(1, len(nodes))]})
    rounds = world_sizes(events)
    if rounds:
        xs = [t - t0 for t, _, _ in rounds] + [events[-1]["time"] - t0]
        ys = [w for _, _, w in rounds] + [rounds[-1][2]]
        top.step(xs, ys, where="post", color="tab:orange")
        for t, r, w in rounds:
            top.annotate(f"r{r}", (t - t0, w), textcoords="offset points", xytext=(2, 3), fontsize=7)
        top.set_ylim(0, max(ys) + 1)
    top.set_ylabel("world size")
    for begin, end in outages(events):
        lanes.axvspan(begin - t0, end - t0, color="0.85")
    lane = {n: i for i, n in enumerate(nodes)}
    for kind, (marker, color) in MARKS.items():
        pts = [(e["time"] - t0, lane[e["node"]]) for e in events if e["event"] == kind]
        if pts:
            lanes.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=kind, s=40)
    lanes.set_yticks(range(len(nodes)), nodes)
    lanes.set_ylim(-0.6, len(nodes) - 0.4)
    lanes.set_xlabel("seconds since the first event")
    lanes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize=8, frameon=False)
    top.set_title(title or f"job {events[0].get('job', '')}")
    save(fig, out, 110)


def scrape(target: str, timeout: float = 2.0) -> List[List[Any]]:
    """The samples of one scrape of ``http://target/metrics``: [name, labels, value] each."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{target}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    return [[s.name, dict(s.labels), s.value] for f in text_string_to_metric_families(text) for s in f.samples]


def scrape_loop(targets: List[str], out_path: Path, every: float, duration: float, idle: float) -> None:
    """Append a scrape of every target to ``out_path`` each ``every`` s until Ctrl-C, ``duration`` s (0: no limit)
    or every target that answered has been silent ``idle`` s; a target that does not answer is skipped."""
    start = time.monotonic()
    last_ok = 0.0
    with open(out_path, "a", encoding="utf-8") as out:
        try:
            while not duration or time.monotonic() - start < duration:
                turn = time.monotonic()
                for target in targets:
                    try:
                        samples = scrape(target)
                    except OSError:
                        continue
                    last_ok = turn
                    out.write(json.dumps({"time": round(time.time(), 3), "target": target, "samples": samples}) + "\n")
                out.flush()
                if last_ok and turn - last_ok > idle:
                    break
                time.sleep(max(0.0, every - (time.monotonic() - turn)))
        except KeyboardInterrupt:
            pass


def read_scrapes(path: Path) -> List[Record]:
    """The scrapes, in time order; SystemExit with one line for a file that is not ``scrape``'s."""
    rows = []
    for n, rec in json_lines(path, "plot_job.py scrape"):
        try:
            rows.append({"time": float(rec["time"]), "target": rec["target"], "samples": rec["samples"]})
        except (KeyError, TypeError, ValueError):
            raise SystemExit(f"plot_job: {path}:{n} is not a scrape (give the file of plot_job.py scrape)") from None
    if not rows:
        raise SystemExit(f"plot_job: {path} holds no scrapes")
    return sorted(rows, key=lambda r: r["time"])


def values(scrapes: List[Record], name: str, by: str = "", match: Optional[Dict[str, str]] = None,
           how: str = "max") -> Series:
    """``how by (by) (name{match})`` at each scrape time, over the latest scrape of every target."""
    latest: Dict[str, Dict[str, float]] = {}
    out: Series = defaultdict(list)
    for s in scrapes:
        picked: Dict[str, float] = defaultdict(float) if how == "sum" else {}
        for sample_name, labels, value in s["samples"]:
            if sample_name == name and all(labels.get(k) == v for k, v in (match or {}).items()):
                key = labels.get(by, "") if by else ""
                picked[key] = picked[key] + value if how == "sum" else value
        latest[s["target"]] = dict(picked)
        merged: Dict[str, float] = {}
        for per_target in latest.values():
            for key, v in per_target.items():
                merged[key] = merged.get(key, 0.0) + v if how == "sum" else max(merged.get(key, -math.inf), v)
        for key, v in merged.items():
            out[key].append((s["time"], v))
    return dict(out)


def rate(series: Series, window: float) -> Series:
    """Per-second change over ``window`` seconds (rate of a counter, deriv of a gauge)."""
    out: Series = {}
    for key, pts in series.items():
        res, j = [], 0
        for t, v in pts:
            while pts[j][0] < t - window:
                j += 1
            t0, v0 = pts[j]
            if t > t0:
                res.append((t, (v - v0) / (t - t0)))
        out[key] = res
    return out


def quantile(q: float, buckets: Dict[str, float]) -> float:
    """Prometheus's histogram_quantile over cumulative bucket counts keyed by ``le``."""
    bounds = sorted(((float(le), c) for le, c in buckets.items()), key=lambda bc: bc[0])
    total = bounds[-1][1] if bounds else 0.0
    if total <= 0:
        return math.nan
    rank, prev_le, prev_c = q * total, 0.0, 0.0
    for le, c in bounds:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c) if c > prev_c else le
        prev_le, prev_c = le, c
    return prev_le


def quantiles(scrapes: List[Record], name: str, q: float, window: float) -> Points:
    """``histogram_quantile(q, sum by (le) (rate(name_bucket[window])))`` at each scrape time."""
    buckets = rate(values(scrapes, name + "_bucket", by="le", how="sum"), window)
    times = sorted({t for pts in buckets.values() for t, _ in pts})
    at = {le: dict(pts) for le, pts in buckets.items()}
    return [(t, quantile(q, {le: at[le].get(t, 0.0) for le in at})) for t in times]


def plot_dashboard(scrapes: List[Record], out: Path, window: float, title: str) -> None:
    """deploy/grafana/elasticrun.json's panels, evaluated over the scrapes."""
    plt = pyplot()
    t0 = scrapes[0]["time"]
    fig, axes = plt.subplots(5, 2, figsize=(13, 15))
    ax = iter(axes.flat)
    steps = {"drawstyle": "steps-post"}

    def line(a: Any, pts: Points, label: str, **kw: Any) -> None:
        a.plot([t - t0 for t, _ in pts], [v for _, v in pts], label=label, **kw)

    def draw(a: Any, series: Series, fmt: str = "{}", **kw: Any) -> None:
        for key, pts in sorted(series.items()):
            if pts:
                line(a, pts, fmt.format(key), **kw)

    def panel(a: Any, name: str, unit: str = "") -> None:
        a.set_title(name, fontsize=10)
        a.set_ylabel(unit)
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7, loc="best")

    a = next(ax)
    for metric, label in (("world_size", "world size"), ("nodes", "nodes"), ("round", "round")):
        draw(a, values(scrapes, f"elasticrun_{metric}"), label, **steps)
    panel(a, "World size, nodes and round")
    a = next(ax)
    draw(a, values(scrapes, "elasticrun_step"), "step")
    b = a.twinx()
    draw(b, rate(values(scrapes, "elasticrun_step"), 60), "steps/s (right)", color="tab:red")
    b.legend(fontsize=7, loc="lower right")
    panel(a, "Step and step rate", "step")
    a = next(ax)
    trained = values(scrapes, "elasticrun_phase_seconds_total", match={"phase": "training"}, how="sum")[""]
    lost = values(scrapes, "elasticrun_training_lost_seconds_total", how="sum")[""]
    wall = values(scrapes, "elasticrun_phase_seconds_total", how="sum")[""]
    line(a, [(t, (g - x) / w if w else 0) for (_, g), (_, x), (t, w) in zip(trained, lost, wall)], "job", lw=2)
    draw(a, values(scrapes, "elasticrun_goodput_ratio", by="node_id"), "node {}")
    a.set_ylim(0, 1)
    panel(a, "Goodput ratio")
    a = next(ax)
    badput = values(scrapes, "elasticrun_badput_seconds_total", by="cause", how="sum")
    bad = rate(badput, window)
    keys = [k for k in sorted(bad) if any(v > 0 for _, v in bad[k])]
    if keys:
        a.stackplot([t - t0 for t, _ in bad[keys[0]]], *[[v for _, v in bad[k]] for k in keys], labels=keys)
    panel(a, f"Badput by cause (node-seconds per second, rate over {window:g} s)", "s/s")
    a = next(ax)
    a.barh(list(badput), [pts[-1][1] for pts in badput.values()], color="tab:orange")
    panel(a, "Badput so far by cause")
    a.set_xlabel("node-seconds")
    a = next(ax)
    draw(a, values(scrapes, "elasticrun_restarts_total"), "restarts", **steps)
    draw(a, values(scrapes, "elasticrun_rescales_total", by="type"), "rescales {}", **steps)
    draw(a, values(scrapes, "elasticrun_steps_lost_total"), "steps lost", **steps)
    panel(a, "Restarts and rescales")
    a = next(ax)
    draw(a, rate(values(scrapes, "elasticrun_badput_seconds_total", by="node_id", how="sum",
                        match={"cause": "checkpoint_stall"}), window), "stall s/s {}")
    for hist in ("checkpoint", "snapshot"):
        line(a, quantiles(scrapes, f"elasticrun_{hist}_seconds", 0.9, 300), f"{hist} p90", ls="--")
    panel(a, "Checkpoint stalls", "s")
    a = next(ax)
    for q in (0.5, 0.99):
        pts = quantiles(scrapes, "elasticrun_etcd_request_seconds", q, window)
        line(a, [(t, 1000 * v) for t, v in pts], f"p{int(q * 100)}")
    panel(a, f"etcd request latency (rate over {window:g} s)", "ms")
    a = next(ax)
    lease = values(scrapes, "elasticrun_lease_state", by="node_id", how="sum", match={"state": "held"})
    draw(a, lease, "{} lease held", **steps)
    draw(a, values(scrapes, "elasticrun_leader", by="node_id"), "{} leader", ls=":", **steps)
    a.set_ylim(-0.1, 1.1)
    panel(a, "Lease state and leader")
    next(ax).axis("off")
    for a in axes.flat:
        a.set_xlabel(a.get_xlabel() or "seconds since the first scrape")
    fig.suptitle(title)
    save(fig, out, 90)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Draw a job's metrics log, its agents' event logs or their /metrics")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("metrics", help="a metrics log (examples/train.py --metrics-log) over time")
    m.add_argument("log", type=Path, help="metrics log (examples/train.py --metrics-log)")
    m.add_argument("--reference", type=Path, help="metrics log of the uninterrupted run, drawn on the loss panel")
    e = sub.add_parser("events", help="a job's timeline from its --events-file logs")
    e.add_argument("events", type=Path, nargs="+", help="--events-file logs (one per node, or shared)")
    e.add_argument("--print", action="store_true", help="print the timeline as text instead of drawing it")
    sc = sub.add_parser("scrape", help="append scrapes of agents' /metrics to a JSON-lines file")
    sc.add_argument("targets", nargs="+", help="HOST:PORT of each agent's --metrics-port")
    sc.add_argument("-o", "--out", type=Path, required=True, help="JSON-lines file to append to")
    sc.add_argument("--every", type=float, default=0.5, help="seconds between scrapes")
    sc.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: no limit)")
    sc.add_argument("--idle", type=float, default=10.0, help="stop once every target is silent this long")
    d = sub.add_parser("dashboard", help="draw deploy/grafana/elasticrun.json's panels from the scrapes")
    d.add_argument("scrapes", type=Path, help="the file of plot_job.py scrape")
    d.add_argument("--window", type=float, default=5.0, help="seconds a rate() looks back")
    for cmd, png, title in ((m, "run.png", ""), (e, "timeline.png", ""),
                            (d, "dashboard.png", "elasticrun dashboard panels, drawn from a real run's scrapes")):
        cmd.add_argument("-o", "--out", type=Path, default=Path(png), help="the PNG to write")
        cmd.add_argument("--title", default=title)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.cmd == "scrape":
        scrape_loop(args.targets, args.out, args.every, args.duration, args.idle)
    elif args.cmd == "events" and args.print:
        print("\n".join(describe(read_events(args.events))))
    elif args.cmd == "events":
        plot_events(read_events(args.events), args.out, args.title)
        print(f"wrote {args.out}")
    elif args.cmd == "dashboard":
        plot_dashboard(read_scrapes(args.scrapes), args.out, args.window, args.title)
        print(f"wrote {args.out}")
    else:
        rows = read_log(args.log)
        plot_metrics(rows, args.out, read_log(args.reference) if args.reference else None, args.title)
        paused = sum(b - a for a, b in pauses(rows))
        print(f"wrote {args.out}: {len(rows)} steps, {len(rescales(rows))} rescale(s), {paused:.1f}s without training")
    return 0


if __name__ == "__main__":
    sys.exit(main())
