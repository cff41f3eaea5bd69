"""The charts of docs/performance.md, drawn from ``perf_data.chart_data`` (plain dicts and lists) by
perf_report.py; needs matplotlib (``pip install 'elasticrun[plot]'``). Each chart is written only when there
is data for it. Run alone, it draws the rendezvous-at-scale chart from ``bench_rendezvous.py --out FILE``::

    python scripts/perf/perf_charts.py rdzv.json -o docs/img/perf-rendezvous.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

try:
    import matplotlib
except ImportError:  # perf_report.py checks first; run alone, this says what to install
    sys.exit("perf_charts: the charts need matplotlib: pip install 'elasticrun[plot]'")

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

ER_COLOR = "#1f77b4"
ALT_COLOR = "#d62728"
DPI = 110
TOOL_COLORS = {"elasticrun": ER_COLOR, "safetensors": "#ff7f0e", "dcp": "#2ca02c", "torch": "#9467bd",
               "disk": "grey"}


def _color(label: str) -> str:
    return ER_COLOR if label.lower().startswith("elasticrun") else ALT_COLOR


def _tool_style(name: str, k: int) -> Dict[str, Any]:
    """Line style of a checkpoint series: a colour per tool, elasticrun's variants thick, in line styles."""
    low = name.lower()
    tool = next((t for t in TOOL_COLORS if low.startswith(t)), "")
    style: Dict[str, Any] = {"color": TOOL_COLORS.get(tool)}
    if tool == "elasticrun":
        style.update(lw=2.4, ls=("-", "--", "-.", ":")[k % 4])
    elif tool == "disk":
        style.update(ls="--", lw=1)
    return style


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def strip_chart(groups: List[Dict[str, Any]], title: str, path: Path) -> Path:
    """One row per launcher/variant: every successful run as a dot, the median as a bar, runs that
    failed or hung counted on the right; phase marks of the median run, when given, as ticks."""
    fig, ax = plt.subplots(figsize=(8.5, 0.55 * len(groups) + 1.6))
    worst = max([t for g in groups for t in g["times"]] + [1.0])
    names = list(dict.fromkeys(n for g in groups for n, _ in g.get("phases") or []))
    palette = plt.get_cmap("Dark2")
    phase_colors = {n: palette(i % 8) for i, n in enumerate(names)}
    shown: set = set()
    for y, g in enumerate(groups):
        times, color = g["times"], _color(g["label"])
        if times:
            med = statistics.median(times)
            ax.barh(y, med, color=color, alpha=0.25, height=0.6)
            ax.plot(times, [y] * len(times), "o", color=color, ms=5)
            ax.text(med, y + 0.32, f" {med:.2f} s", va="bottom", fontsize=8)
        for name, t in g.get("phases") or []:
            ax.plot([t, t], [y - 0.32, y + 0.32], color=phase_colors[name], lw=2.2,
                    label=name if name not in shown else None)
            shown.add(name)
        bad = g["runs"] - len(times)
        if bad:
            ax.text(worst * 1.02, y, f"{bad}/{g['runs']} failed or hung", va="center", fontsize=8, color=ALT_COLOR)
    ax.set_yticks(range(len(groups)))
    ax.set_yticklabels([g["label"] for g in groups], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, worst * 1.35)
    ax.set_xlabel("seconds (dots: runs; bar: median)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    if names:
        ax.legend(title="phases (median run)", fontsize=7, title_fontsize=7, loc="lower right")
    return _save(fig, path)


def checkpoint_chart(data: Dict[str, Dict[str, List[Tuple[float, float]]]], device: str, path: Path,
                     note: str = "") -> Path:
    """Throughput (GB/s) against state size, one panel per operation, one line per tool/variant."""
    ops = [op for op in ("save", "load") if op in data]
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        er = 0
        for name, pts in sorted(data[op].items()):
            pts = sorted(pts)
            xs, ys = [p[0] for p in pts], [p[1] for p in pts]
            style = _tool_style(name, er)
            er += name.startswith("elasticrun")
            ax.plot(xs, ys, marker="o", label=name, **style)
        sizes = sorted({p[0] for pts in data[op].values() for p in pts})
        ax.set_xscale("log")
        ax.set_xticks(sizes)
        ax.set_xlim(sizes[0] / 1.6, sizes[-1] * 1.6)
        ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%.2g"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_ylim(bottom=0)
        ax.set_xlabel("state size (GB)")
        ax.set_ylabel("GB/s (higher is better)")
        how = "durable" if op == "save" else "cold page cache"
        ax.set_title(f"checkpoint {op} ({', '.join(x for x in (note, device, how) if x)})", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


RDZV_PANELS = (  # (row key, y label, guide: "linear" in the nodes or "flat")
    ("all_hold_s", "seconds until every agent holds the round", "linear"),
    ("cpu_per_agent_ms", "agents' CPU per agent (ms)", "flat"),
    ("etcd_cpu_s", "etcd CPU per round (s)", "linear"),
    ("etcd_writes", "etcd writes per round", "linear"),
)
RDZV_PHASES = {"round 0": "round 0 (all register)", "loss": "re-form after a node is SIGKILLed",
               "join": "re-form after a node joins"}


def _series(rows: List[Dict[str, Any]], key: str) -> Dict[str, List[Tuple[int, float]]]:
    """Phase -> sorted (nodes, value) of the rows that completed (the median where a size ran more than once)."""
    by: Dict[str, Dict[int, List[float]]] = {}
    for r in rows:
        if "failed" not in r and isinstance(r.get(key), (int, float)):
            by.setdefault(str(r["phase"]), {}).setdefault(int(r["nodes"]), []).append(float(r[key]))
    return {ph: [(n, statistics.median(v)) for n, v in sorted(pts.items())] for ph, pts in by.items()}


def rendezvous_chart(data: Dict[str, Any], path: Path) -> Path:
    """Four log-log panels against the node count, one line per phase (round 0, a loss, a join): the time until
    every agent holds the round, the agents' CPU per agent, etcd's CPU and writes per round; grey dotted guides
    linear in the nodes from the smallest run (time, etcd) or flat and 2x (per agent)."""
    rows = data["rows"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for ax, (key, label, guide) in zip(axes.flat, RDZV_PANELS):
        for phase, pts in _series(rows, key).items():
            ns, ys = [n for n, _ in pts], [y for _, y in pts]
            ax.plot(ns, ys, marker="o", label=RDZV_PHASES.get(phase, phase))
            if phase == "round 0" and ys[0] > 0:
                for k in ((1,) if guide == "linear" else (1, 2)):
                    ax.plot(ns, [k * ys[0] * (n / ns[0] if guide == "linear" else 1) for n in ns], ls=":",
                            color="grey", lw=1)
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
    loads = [r["load"] for r in rows if isinstance(r.get("load"), (int, float))]
    fig.suptitle(f"Rendezvous at scale — SIMULATED: all agents on one {data.get('cpus', '?')}-core machine with "
                 f"one etcd" + (f"; did not complete: {', '.join(failed)}" if failed else "")
                 + (f"\nload average {min(loads):.0f}–{max(loads):.0f} on the shared machine during the run"
                    if loads else ""), fontsize=10)
    fig.text(0.5, 0.005, data.get("command", ""), ha="center", fontsize=7, family="monospace")
    fig.tight_layout(rect=(0, 0.02, 1, 0.97))
    return _save(fig, path)


def draw_all(data: Dict[str, Any], img_dir: Path) -> List[Path]:
    """Every chart there is data for, written as ``img_dir/perf-*.png``."""
    out: List[Path] = []
    if data.get("recovery"):
        out.append(strip_chart(data["recovery"], "crash → first training step after recovery", img_dir /
                               "perf-recovery.png"))
    if data.get("launch"):
        out.append(strip_chart(data["launch"], "launch → first training step",
                               img_dir / "perf-launch.png"))
    if data.get("checkpoint"):
        out.append(checkpoint_chart(data["checkpoint"], data.get("device", "cpu"), img_dir / "perf-checkpoint.png",
                                    data.get("checkpoint_note", "")))
    for name, doc in data.get("rendezvous", {}).items():
        out.append(rendezvous_chart(doc, img_dir / f"perf-{name}.png"))
    if data.get("scaleup"):
        out.append(strip_chart(data["scaleup"], "scale-up: new node's agent started → its first step in the job",
                               img_dir / "perf-scaleup.png"))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """The rendezvous-at-scale chart of one ``bench_rendezvous.py --out FILE``."""
    ap = argparse.ArgumentParser(description="Draw the rendezvous-at-scale chart from bench_rendezvous.py --out FILE")
    ap.add_argument("rows", type=Path, help="the JSON file of bench_rendezvous.py --out")
    ap.add_argument("-o", "--output", type=Path, default=Path("docs/img/perf-rendezvous.png"))
    args = ap.parse_args(argv)
    try:
        data = json.loads(args.rows.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError("no 'rows' list")
    except (OSError, ValueError) as err:
        print(f"perf_charts: cannot read {args.rows}: {err}; give the file of bench_rendezvous.py --out",
              file=sys.stderr)
        return 2
    args.output.parent.mkdir(parents=True, exist_ok=True)
    print(rendezvous_chart(data, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
