"""The charts of docs/performance.md, drawn from ``perf_report.chart_data`` (plain dicts and lists).

Used by ``scripts/perf/perf_report.py``; needs matplotlib (``pip install 'elasticrun[plot]'``). Each chart
is written only when there is data for it; the paths written are returned.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Dict, List, Tuple

import matplotlib

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


def rendezvous_chart(series: Dict[str, Dict[int, float]], path: Path) -> Path:
    """Seconds until every agent holds round 0 against node count, log-log, with a linear guide."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, pts in sorted(series.items()):
        if not pts:
            continue
        ns = sorted(pts)
        ax.plot(ns, [pts[n] for n in ns], marker="o", label=name, color=_color(name) if "torch" in name else None)
        n0 = ns[0]
        ax.plot(ns, [pts[n0] * n / n0 for n in ns], ls=":", color="grey", lw=1)
    ax.plot([], [], ls=":", color="grey", label="linear in nodes (from the smallest run)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes (simulated agents)")
    ax.set_ylabel("seconds until every agent holds round 0")
    ax.set_title("rendezvous time against nodes (one etcd)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
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
    if any(data.get("rendezvous", {}).values()):
        out.append(rendezvous_chart(data["rendezvous"], img_dir / "perf-rendezvous.png"))
    if data.get("scaleup"):
        out.append(strip_chart(data["scaleup"], "scale-up: new node's agent started → its first step in the job",
                               img_dir / "perf-scaleup.png"))
    return out
