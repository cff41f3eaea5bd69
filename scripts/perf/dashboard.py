"""Scrape agents' ``/metrics`` into a JSON-lines file (what Prometheus would store), and draw
deploy/grafana/elasticrun.json's panels from it (no Grafana needed)::

    python scripts/perf/dashboard.py scrape 127.0.0.1:9400 127.0.0.1:9401 -o scrapes.jsonl --every 0.5
    python scripts/perf/dashboard.py draw scrapes.jsonl -o docs/img/observability.png

``scrape`` writes one line per successful scrape: ``{"time", "target", "samples": [[name, {labels}, value], ...]}``;
a target that does not answer is skipped that turn. It stops on Ctrl-C, after ``--duration`` seconds, or once
every target that answered has been silent for ``--idle`` s. ``draw`` evaluates each panel's PromQL (in the
dashboard and docs/observability.md) by hand over the scrapes: sums and maxima across the agents at each scrape
time, ``rate``/``deriv`` as differences over ``--window`` seconds, ``histogram_quantile`` by Prometheus's linear
interpolation within the bucket. Drawing needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

Series = Dict[str, List[Tuple[float, float]]]


def scrape(target: str, timeout: float = 2.0) -> List[List[Any]]:
    """The samples of one scrape of ``http://target/metrics``: [name, labels, value] each."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{target}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    return [[s.name, dict(s.labels), s.value] for f in text_string_to_metric_families(text) for s in f.samples]


def scrape_loop(targets: List[str], out_path: Path, every: float, duration: float, idle: float) -> None:
    """Append a scrape of every target to ``out_path`` each ``every`` s until a stop condition holds."""
    start = time.monotonic()
    last_ok = {t: 0.0 for t in targets}
    with open(out_path, "a", encoding="utf-8") as out:
        try:
            while not duration or time.monotonic() - start < duration:
                turn = time.monotonic()
                for target in targets:
                    try:
                        samples = scrape(target)
                    except OSError:
                        continue
                    last_ok[target] = turn
                    out.write(json.dumps({"time": round(time.time(), 3), "target": target, "samples": samples}) + "\n")
                out.flush()
                seen = [t for t in last_ok.values() if t]
                if seen and turn - max(seen) > idle:
                    break
                time.sleep(max(0.0, every - (time.monotonic() - turn)))
        except KeyboardInterrupt:
            pass


def read_scrapes(path: Path) -> List[Dict[str, Any]]:
    """The scrapes, in time order; SystemExit with one line for a file that is not ``scrape``'s."""
    rows = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SystemExit(f"dashboard: cannot read {path} ({getattr(err, 'strerror', None) or err}); "
                         "give the file of dashboard.py scrape") from None
    for n, line in enumerate(text.splitlines(), 1):
        try:
            rec = json.loads(line)
            rows.append({"time": float(rec["time"]), "target": rec["target"], "samples": rec["samples"]})
        except (ValueError, KeyError, TypeError):
            raise SystemExit(f"dashboard: {path}:{n} is not a scrape (give the file of dashboard.py scrape)") from None
    if not rows:
        raise SystemExit(f"dashboard: {path} holds no scrapes")
    return sorted(rows, key=lambda r: r["time"])


def values(scrapes: List[Dict[str, Any]], name: str, by: str = "", match: Optional[Dict[str, str]] = None,
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


def quantiles(scrapes: List[Dict[str, Any]], name: str, q: float, window: float) -> List[Tuple[float, float]]:
    """``histogram_quantile(q, sum by (le) (rate(name_bucket[window])))`` at each scrape time."""
    buckets = rate(values(scrapes, name + "_bucket", by="le", how="sum"), window)
    times = sorted({t for pts in buckets.values() for t, _ in pts})
    at = {le: dict(pts) for le, pts in buckets.items()}
    return [(t, quantile(q, {le: at[le].get(t, 0.0) for le in at})) for t in times]


def plot(scrapes: List[Dict[str, Any]], out: Path, window: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = scrapes[0]["time"]
    fig, axes = plt.subplots(5, 2, figsize=(13, 15))
    ax = axes.flat

    def draw(a: Any, series: Series, fmt: str = "{}", **kw: Any) -> None:
        for key, pts in sorted(series.items()):
            if pts:
                a.plot([t - t0 for t, _ in pts], [v for _, v in pts], label=fmt.format(key), **kw)

    def panel(a: Any, name: str, unit: str = "") -> None:
        a.set_title(name, fontsize=10)
        a.set_ylabel(unit)
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=7, loc="best")

    a = next(ax)
    draw(a, values(scrapes, "elasticrun_world_size"), "world size", drawstyle="steps-post")
    draw(a, values(scrapes, "elasticrun_nodes"), "nodes", drawstyle="steps-post")
    draw(a, values(scrapes, "elasticrun_round"), "round", drawstyle="steps-post")
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
    a.plot([t - t0 for t, _ in wall], [(g - x) / w if w else 0 for (_, g), (_, x), (_, w) in zip(trained, lost, wall)],
           label="job", lw=2)
    draw(a, values(scrapes, "elasticrun_goodput_ratio", by="node_id"), "node {}")
    a.set_ylim(0, 1)
    panel(a, "Goodput ratio")
    a = next(ax)
    bad = rate(values(scrapes, "elasticrun_badput_seconds_total", by="cause", how="sum"), window)
    keys = [k for k in sorted(bad) if any(v > 0 for _, v in bad[k])]
    if keys:
        ts = [t - t0 for t, _ in bad[keys[0]]]
        a.stackplot(ts, *[[v for _, v in bad[k]] for k in keys], labels=keys)
    panel(a, f"Badput by cause (node-seconds per second, rate over {window:g} s)", "s/s")
    a = next(ax)
    final = {k: pts[-1][1] for k, pts in values(scrapes, "elasticrun_badput_seconds_total", by="cause",
                                                 how="sum").items()}
    a.barh(list(final), list(final.values()), color="tab:orange")
    panel(a, "Badput so far by cause", "")
    a.set_xlabel("node-seconds")
    a = next(ax)
    draw(a, values(scrapes, "elasticrun_restarts_total"), "restarts", drawstyle="steps-post")
    draw(a, values(scrapes, "elasticrun_rescales_total", by="type"), "rescales {}", drawstyle="steps-post")
    draw(a, values(scrapes, "elasticrun_steps_lost_total"), "steps lost", drawstyle="steps-post")
    panel(a, "Restarts and rescales")
    a = next(ax)
    draw(a, rate(values(scrapes, "elasticrun_badput_seconds_total", by="node_id", how="sum",
                        match={"cause": "checkpoint_stall"}), window), "stall s/s {}")
    for hist in ("checkpoint", "snapshot"):
        pts = quantiles(scrapes, f"elasticrun_{hist}_seconds", 0.9, 300)
        a.plot([t - t0 for t, _ in pts], [v for _, v in pts], label=f"{hist} p90", ls="--")
    panel(a, "Checkpoint stalls", "s")
    a = next(ax)
    for q in (0.5, 0.99):
        pts = quantiles(scrapes, "elasticrun_etcd_request_seconds", q, window)
        a.plot([t - t0 for t, _ in pts], [1000 * v for _, v in pts], label=f"p{int(q * 100)}")
    panel(a, f"etcd request latency (rate over {window:g} s)", "ms")
    a = next(ax)
    lease = values(scrapes, "elasticrun_lease_state", by="node_id", how="sum", match={"state": "held"})
    draw(a, lease, "{} lease held", drawstyle="steps-post")
    draw(a, values(scrapes, "elasticrun_leader", by="node_id"), "{} leader", drawstyle="steps-post", ls=":")
    a.set_ylim(-0.1, 1.1)
    panel(a, "Lease state and leader")
    next(ax).axis("off")
    for a in axes.flat:
        a.set_xlabel(a.get_xlabel() or "seconds since the first scrape")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="Scrape agents' /metrics, or draw the dashboard's panels from scrapes")
    sub = p.add_subparsers(dest="cmd", required=True)
    sc = sub.add_parser("scrape", help="append scrapes of agents' /metrics to a JSON-lines file")
    sc.add_argument("targets", nargs="+", help="HOST:PORT of each agent's --metrics-port")
    sc.add_argument("-o", "--out", type=Path, required=True, help="JSON-lines file to append to")
    sc.add_argument("--every", type=float, default=0.5, help="seconds between scrapes")
    sc.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: no limit)")
    sc.add_argument("--idle", type=float, default=10.0, help="stop once every target is silent this long")
    dr = sub.add_parser("draw", help="draw deploy/grafana/elasticrun.json's panels from the scrapes")
    dr.add_argument("scrapes", type=Path, help="the file of dashboard.py scrape")
    dr.add_argument("-o", "--out", type=Path, default=Path("dashboard.png"))
    dr.add_argument("--window", type=float, default=5.0, help="seconds a rate() looks back")
    dr.add_argument("--title", default="elasticrun dashboard panels, drawn from a real run's scrapes")
    args = p.parse_args(argv)
    if args.cmd == "scrape":
        scrape_loop(args.targets, args.out, args.every, args.duration, args.idle)
        return 0
    plot(read_scrapes(args.scrapes), args.out, args.window, args.title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
