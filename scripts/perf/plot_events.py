"""Draw a job's timeline from its agents' ``--events-file`` logs (JSON lines).

Every agent appends ``{"time", "event", "job", "node", ...}`` records: ``round_formed``,
``rescale``, ``restart``, ``checkpoint_committed``, ``hang``, ``outage_begin``/``outage_end``,
``job_ended`` (see elasticrun/launch/events.py). Give one file per node, or one file several
agents share. The picture: the world size of each round as a step line, one lane per node
below it with a mark per event, and outages shaded::

    python scripts/perf/plot_events.py events.jsonl -o timeline.png
    python scripts/perf/plot_events.py events-*.jsonl --print      # the timeline as text, no drawing

Drawing needs matplotlib: ``pip install 'elasticrun[plot]'``; ``--print`` does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

KINDS = ("round_formed", "rescale", "restart", "checkpoint_committed", "hang", "outage_begin", "outage_end",
         "job_ended")
MARKS = {"rescale": ("D", "tab:blue"), "restart": ("X", "tab:red"), "checkpoint_committed": ("|", "tab:green"),
         "hang": ("v", "tab:purple"), "outage_begin": ("<", "tab:gray"), "outage_end": (">", "tab:gray"),
         "job_ended": ("s", "black"), "round_formed": ("o", "tab:orange")}


def read_events(paths: List[Path]) -> List[Dict[str, Any]]:
    """Every event of ``paths``, in time order; SystemExit with one line for a file that is not an events log."""
    events: List[Dict[str, Any]] = []
    for path in paths:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise SystemExit(f"plot_events: cannot read {path} ({err.strerror}); "
                             "give the file of --events-file") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                raise SystemExit(f"plot_events: {path}:{n} is not JSON (give the file of --events-file)") from None
            if not isinstance(rec, dict) or not {"time", "event", "node"} <= set(rec):
                raise SystemExit(f"plot_events: {path}:{n} lacks time/event/node (is it an --events-file log?)")
            events.append(rec)
    if not events:
        raise SystemExit("plot_events: no events in " + ", ".join(map(str, paths)))
    return sorted(events, key=lambda e: e["time"])


def world_sizes(events: List[Dict[str, Any]]) -> List[Tuple[float, int, int]]:
    """(time, round, world size) of every round, once per round (the first node to log it)."""
    seen: Dict[int, Tuple[float, int, int]] = {}
    for e in events:
        if e["event"] == "round_formed" and e.get("round") not in seen:
            seen[e["round"]] = (e["time"], e["round"], int(e.get("world_size", 0)))
    return sorted(seen.values())


def outages(events: List[Dict[str, Any]]) -> List[Tuple[str, float, Optional[float]]]:
    """(node, begin, end or None while still open) of every outage."""
    open_: Dict[str, float] = {}
    spans: List[Tuple[str, float, Optional[float]]] = []
    for e in events:
        if e["event"] == "outage_begin":
            open_[e["node"]] = e["time"]
        elif e["event"] == "outage_end" and e["node"] in open_:
            spans.append((e["node"], open_.pop(e["node"]), e["time"]))
    spans += [(node, begin, None) for node, begin in open_.items()]
    return spans


def describe(events: List[Dict[str, Any]]) -> List[str]:
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


def plot(events: List[Dict[str, Any]], out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = events[0]["time"]
    end = events[-1]["time"] - t0
    nodes = sorted({e["node"] for e in events})
    fig, (top, lanes) = plt.subplots(2, 1, figsize=(10, 2.2 + 0.5 * len(nodes)), sharex=True,
                                     gridspec_kw={"height_ratios": [2, max(1, len(nodes))]})
    rounds = world_sizes(events)
    if rounds:
        xs = [t - t0 for t, _, _ in rounds] + [end]
        ys = [w for _, _, w in rounds] + [rounds[-1][2]]
        top.step(xs, ys, where="post", color="tab:orange")
        for t, r, w in rounds:
            top.annotate(f"r{r}", (t - t0, w), textcoords="offset points", xytext=(2, 3), fontsize=7)
        top.set_ylim(0, max(ys) + 1)
    top.set_ylabel("world size")
    lane = {n: i for i, n in enumerate(nodes)}
    for _node, begin, stop in outages(events):
        lanes.axvspan(begin - t0, (stop if stop is not None else events[-1]["time"]) - t0, color="0.85")
    for kind in KINDS:
        pts = [(e["time"] - t0, lane[e["node"]]) for e in events if e["event"] == kind]
        if pts:
            marker, color = MARKS[kind]
            lanes.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=kind, s=40)
    lanes.set_yticks(range(len(nodes)), nodes)
    lanes.set_ylim(-0.6, len(nodes) - 0.4)
    lanes.set_xlabel("seconds since the first event")
    lanes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=4, fontsize=8, frameon=False)
    top.set_title(title or f"job {events[0].get('job', '')}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("events", type=Path, nargs="+", help="--events-file logs (one per node, or shared)")
    p.add_argument("-o", "--out", type=Path, default=Path("timeline.png"))
    p.add_argument("--title", default="")
    p.add_argument("--print", action="store_true", help="print the timeline as text instead of drawing it")
    args = p.parse_args(argv)
    events = read_events(args.events)
    if args.print:
        print("\n".join(describe(events)))
        return 0
    try:
        plot(events, args.out, args.title)
    except ImportError:
        print("plot_events: drawing needs matplotlib: pip install 'elasticrun[plot]' (or use --print)", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
