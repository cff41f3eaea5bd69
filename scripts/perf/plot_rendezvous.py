#!/usr/bin/env python
"""The rendezvous-at-scale chart of docs/performance.md, from ``bench_rendezvous.py --out FILE``.

Four log-log panels against the node count, one line per phase (round 0, re-forming after a
loss, after a join): the time until every agent holds the round, the agents' CPU per agent, and
etcd's CPU and committed writes per round. Grey dotted guides: linear in the nodes from the
smallest run (time, etcd) or flat (per agent). The figure is labelled as simulated, with the
machine's CPU count and the command of the run.

    python scripts/bench/bench_rendezvous.py --clients shared --nodes 256 512 1024 2048 4096 --out rdzv.json
    python scripts/perf/plot_rendezvous.py rdzv.json -o docs/img/rendezvous-scaling.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

PANELS = (  # (row key, y label, guide: "linear" in the nodes or "flat")
    ("all_hold_s", "seconds until every agent holds the round", "linear"),
    ("cpu_per_agent_ms", "agents' CPU per agent (ms)", "flat"),
    ("etcd_cpu_s", "etcd CPU per round (s)", "linear"),
    ("etcd_writes", "etcd writes per round", "linear"),
)
PHASE_LABELS = {"round 0": "round 0 (all register)", "loss": "re-form after a node is SIGKILLed",
                "join": "re-form after a node joins"}


def series(rows: List[Dict[str, Any]], key: str) -> Dict[str, List[Tuple[int, float]]]:
    """Phase -> sorted (nodes, value) of the rows that completed (the median where a size ran twice)."""
    by: Dict[str, Dict[int, List[float]]] = {}
    for r in rows:
        if "failed" in r or r.get(key) is None:
            continue
        by.setdefault(r["phase"], {}).setdefault(int(r["nodes"]), []).append(float(r[key]))
    return {ph: [(n, sorted(v)[len(v) // 2]) for n, v in sorted(pts.items())] for ph, pts in by.items()}


def draw(data: Dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    rows = data["rows"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for ax, (key, label, guide) in zip(axes.flat, PANELS):
        for phase, pts in series(rows, key).items():
            if not pts:
                continue
            ns, ys = [n for n, _ in pts], [y for _, y in pts]
            ax.plot(ns, ys, marker="o", label=PHASE_LABELS.get(phase, phase))
            if phase == "round 0" and ys[0] > 0:
                ref = [ys[0] * n / ns[0] for n in ns] if guide == "linear" else [ys[0]] * len(ns)
                ax.plot(ns, ref, ls=":", color="grey", lw=1)
                if guide == "flat":
                    ax.plot(ns, [2 * ys[0]] * len(ns), ls=":", color="grey", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ticker.FuncFormatter(lambda v, _pos: f"{v:g}"))
            axis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel("nodes (simulated agents)")
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes.flat[0].plot([], [], ls=":", color="grey", label="linear in the nodes / flat and 2× (round 0)")
    axes.flat[0].legend(fontsize=7)
    failed = sorted({f"{r['nodes']} ({r['phase']})" for r in rows if "failed" in r})
    title = (f"Rendezvous at scale — SIMULATED: all agents on one {data.get('cpus', '?')}-core machine with one etcd"
             + (f"; did not complete: {', '.join(failed)}" if failed else ""))
    loads = [r["load"] for r in rows if isinstance(r.get("load"), (int, float))]
    if loads:
        title += f"\nload average {min(loads):.0f}–{max(loads):.0f} on the shared machine during the run"
    fig.suptitle(title, fontsize=10)
    fig.text(0.5, 0.005, data.get("command", ""), ha="center", fontsize=7, family="monospace")
    fig.tight_layout(rect=(0, 0.02, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows", help="the JSON file of bench_rendezvous.py --out")
    ap.add_argument("-o", "--output", default="docs/img/rendezvous-scaling.png", help="the image to write")
    args = ap.parse_args(argv)
    try:
        with open(args.rows) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError("no 'rows' list")
    except (OSError, ValueError) as err:
        print(f"cannot read {args.rows}: {err}; give the file written by bench_rendezvous.py --out", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("this needs matplotlib: pip install 'elasticrun[plot]'", file=sys.stderr)
        return 2
    print(draw(data, Path(args.output)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
