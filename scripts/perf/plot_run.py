"""Draw an elastic training run: world size, LR, global batch, loss and samples/s over time.

Input: the JSON-lines metrics log of ``examples/train.py --metrics-log FILE`` (one object
per step: time, step, round, world, lr, global_batch, loss, samples_per_s). Every change
of world size is marked with a vertical line on every panel. A second log given with
``--reference`` (e.g. the same job run without interruptions) is drawn on the loss panel
against the step number, so the two loss curves can be compared::

    python scripts/perf/plot_run.py run.jsonl --reference ref.jsonl -o docs/img/elastic_run.png

Needs matplotlib: ``pip install 'elasticrun[plot]'``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

FIELDS = ("time", "step", "world", "lr", "global_batch", "loss", "samples_per_s")


def read_log(path: Path) -> List[Dict[str, Any]]:
    """The step records of a metrics log, in step order; the last record of a step wins (a step
    trained again after a rollback replaces the one that was lost)."""
    by_step: Dict[int, Dict[str, Any]] = {}
    order: List[Dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                raise SystemExit(f"plot_run: {path}:{n} is not JSON (give the file of --metrics-log)") from None
            missing = [k for k in FIELDS if k not in rec]
            if missing:
                raise SystemExit(f"plot_run: {path}:{n} lacks {', '.join(missing)} (is it a --metrics-log file?)")
            order.append(rec)
            by_step[int(rec["step"])] = rec
    if not order:
        raise SystemExit(f"plot_run: {path} holds no steps")
    return [by_step[s] for s in sorted(by_step)]


def pauses(rows: List[Dict[str, Any]]) -> List[Tuple[float, float]]:
    """(start, end) times when no step was trained: between the last step of a round and the first
    step of the next one (the rescale or restart: stop, rendezvous, worker start, resume)."""
    return [(float(a["time"]), float(b["time"])) for a, b in zip(rows, rows[1:])
            if a.get("round") != b.get("round")]


def rescales(rows: List[Dict[str, Any]]) -> List[Tuple[float, int, int]]:
    """(time, old world, new world) for every change of world size."""
    out = []
    for prev, cur in zip(rows, rows[1:]):
        if cur["world"] != prev["world"]:
            out.append((float(cur["time"]), int(prev["world"]), int(cur["world"])))
    return out


def plot(rows: List[Dict[str, Any]], out: Path, reference: Optional[List[Dict[str, Any]]] = None,
         title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("plot_run: matplotlib is needed: pip install 'elasticrun[plot]'") from None
    t0 = float(rows[0]["time"])
    panels = [("world", "world size", "steps-post"), ("lr", "learning rate", "steps-post"),
              ("global_batch", "global batch", "steps-post"), ("loss", "loss", None),
              ("samples_per_s", "samples/s", None)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 9), sharex=True)
    marks = rescales(rows)
    gaps = pauses(rows)
    for ax, (key, label, draw) in zip(axes, panels):
        _panel(ax, rows, key, label, draw, t0, marks, gaps if ax is axes[3] else [])
        for a, b in gaps:  # the pauses shaded on every panel, labelled on the loss panel
            ax.axvspan(a - t0, b - t0, color="0.85", lw=0)
    for when, old, new in marks:
        axes[0].annotate(f"{old}→{new}", (when - t0, new), textcoords="offset points", xytext=(3, 4), fontsize=8)
    if reference:
        # the uninterrupted run on the same time axis as the elastic run's steps: by step number
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
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def _panel(ax: Any, rows: List[Dict[str, Any]], key: str, label: str, draw: Optional[str], t0: float,
           marks: List[Tuple[float, int, int]], legend_gaps: List[Tuple[float, float]]) -> None:
    """One quantity over time, one line per round (no line across a pause); rescales as dashed lines."""
    t = [float(r["time"]) - t0 for r in rows]
    ys = [float(r[key]) for r in rows]
    for k, (lo, hi) in enumerate(_segments(rows)):
        ax.plot(t[lo:hi], ys[lo:hi], drawstyle=draw or "default", color="tab:blue", lw=1.5,
                label="elastic run" if k == 0 else None)
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if legend_gaps:
        ax.axvspan(*(x - t0 for x in legend_gaps[0]), color="0.85", lw=0, label="no training (rescale/restart)")
    for when, old, new in marks:
        ax.axvline(when - t0, color="tab:red" if new < old else "tab:green", ls="--", lw=1)


def _segments(rows: List[Dict[str, Any]]) -> List[Tuple[int, int]]:
    """Index ranges [lo, hi) of consecutive rows of the same round."""
    out, lo = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i].get("round") != rows[i - 1].get("round"):
            out.append((lo, i))
            lo = i
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", type=Path, help="metrics log (examples/train.py --metrics-log)")
    p.add_argument("--reference", type=Path, help="metrics log of the uninterrupted run, drawn on the loss panel")
    p.add_argument("-o", "--out", type=Path, default=Path("run.png"))
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    for path in (a.log, a.reference):
        if path is not None and not path.is_file():
            raise SystemExit(f"plot_run: {path} does not exist")
    rows = read_log(a.log)
    plot(rows, a.out, read_log(a.reference) if a.reference else None, a.title)
    paused = sum(b - a for a, b in pauses(rows))
    print(f"wrote {a.out}: {len(rows)} steps, {len(rescales(rows))} rescale(s), {paused:.1f}s without training")
    return 0


if __name__ == "__main__":
    sys.exit(main())
