#!/usr/bin/env python
"""Turn a ``scripts/bench/run_all.py`` output dir into the performance page: summary table + charts.

    python scripts/perf/perf_report.py /tmp/perf                        # docs/performance.md + docs/img/perf-*.png
    python scripts/perf/perf_report.py /tmp/perf --no-plots --print     # the table only, on stdout too
    python scripts/perf/perf_report.py --rendezvous rdzv.json -o docs/img/perf-rendezvous.png

The rows are the ``"summary"`` lists of the bench JSON files that the dir's manifest (``bench_all.json``) lists,
or of every ``*.json`` of a dir without one; a missing, unreadable or failed bench is listed under the table. The
table replaces what lies between ``<!-- summary:begin -->`` and ``<!-- summary:end -->`` in the page. The charts
need matplotlib: ``pip install 'elasticrun[plot]'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
BEGIN = "<!-- summary:begin -->"
END = "<!-- summary:end -->"
JSON_DIR = re.compile(r"(--json|--out)([ =])[^ ]*/")  # where run_all put a bench's JSON: not on the page

MANIFEST = "bench_all.json"
SCENARIOS = {"restart": "worker crash", "kill": "node SIGKILL", "join": "node joins", "leave": "node leaves",
             "launch": "1 node", "launch-multi": "several nodes"}  # chart labels
CKPT_OPS = ((" save (durable)", "save"), (" load into existing tensors (cold)", "load"))  # ckpt_compare's labels


@dataclass
class Bench:
    """One bench's JSON file."""

    name: str
    kind: str  # launch, elastic, checkpoint, rendezvous, ...
    data: Any


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


def kind_of(name: str, script: str) -> str:
    """Which bench a file holds: the manifest's script name (``bench_launch.py``), else the file's (``launch-2``)."""
    return (Path(script).stem.replace("bench_", "") if script else name).split("-")[0]


def read_manifest(d: Path, problems: List[str]) -> Dict[str, Any]:
    """The run's manifest ({} without one); a bench that failed goes to ``problems``."""
    if not (d / MANIFEST).exists():
        return {}
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except ValueError as e:
        problems.append(f"{MANIFEST}: not JSON ({e})")
        return {}
    for e in manifest.get("benches", []):
        if e.get("status") != "ok":
            why = "; ".join(e.get("notes") or []) or f"exit code {e.get('returncode')}"
            problems.append(f"{e.get('name')}: {e.get('status')} ({why})")
    return manifest


def load_dir(d: Path) -> Inputs:
    """The manifest and the bench JSON files it lists (every ``*.json`` of a dir without one), and what failed."""
    problems: List[str] = []
    manifest = read_manifest(d, problems)
    listed = {str(e["json"]): str(e.get("script") or "") for e in manifest.get("benches", []) if e.get("json")}
    files = [d / n for n in listed] if "benches" in manifest else sorted(d.glob("*.json"))
    benches: List[Bench] = []
    for p in (p for p in files if p.name != MANIFEST):  # with a manifest, older files in the dir are not read
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            problems.append(f"{p.name}: listed in {MANIFEST} but missing")
            continue
        except (OSError, ValueError) as err:
            problems.append(f"{p.name}: unreadable ({err.__class__.__name__})")
            continue
        benches.append(Bench(p.stem, kind_of(p.stem, listed.get(p.name, "")), data))
    return Inputs(benches, manifest, problems)


def scenario_label(scenario: str) -> str:
    """A chart label for a scenario key: ``restart@1s`` → ``worker crash at 1s``."""
    base, _, at = scenario.partition("@")
    return SCENARIOS.get(base, base) + (f" at {at}" if at else "")


def launch_items(data: Dict[str, Any]) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """(scenario, chart item) per scenario and launcher of bench_launch.py's ``runs``, phases of the median ok run."""
    groups: Dict[Tuple[str, str], List[dict]] = {}
    for r in data["runs"]:
        at = r.get("crash_after")  # a crash at a set moment of the round is a scenario of its own
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
    """(op, tool, tag, (GB, GB/s)) of bench_checkpoint.py's ``compare``; the tag names a non-uniform state or a GPU."""
    comp = data["compare"]
    size = comp["size_bytes"] / 1e9
    tags = [str(comp[k]) for k in ("state", "device") if comp[k] not in ("uniform", "cpu")]
    tag = f" [{', '.join(tags)}]" if tags else ""
    for label, secs in comp["runs"].items():
        found = [(op, label[: -len(suffix)]) for suffix, op in CKPT_OPS if label.endswith(suffix)]
        if label.startswith("disk: cold"):
            found = [("load", "disk: cold read")]
        if found and secs:
            yield found[0][0], found[0][1], tag, (size, size / statistics.median(secs))


def chart_data(inputs: Inputs) -> Dict[str, Any]:
    """Plain data for the charts: strip-chart items, checkpoint throughput by op and tool, rendezvous runs."""
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


@dataclass
class Row:
    """One line of the summary table: an entry of a bench JSON's ``summary`` list and the file it came from."""

    metric: str
    elasticrun: float
    alternative: str
    alt_value: Optional[float]
    unit: str
    ratio: Optional[float]  # > 1: elasticrun is ahead
    device: str
    command: str
    bench: str = ""


def contract_rows(b: Bench, problems: List[str]) -> List[Row]:
    """The bench's ``summary`` list, validated (what is wrong goes to ``problems``)."""
    summary = b.data.get("summary") if isinstance(b.data, dict) else None
    if not isinstance(summary, list):
        problems.append(f"{b.name}.json: no summary list")
        return []
    rows = []
    for i, s in enumerate(summary):
        er = num(s.get("elasticrun")) if isinstance(s, dict) else None
        if er is None or not isinstance(s.get("metric"), str):
            problems.append(f"{b.name}.json: summary[{i}] lacks a metric name or a numeric elasticrun value")
            continue
        rows.append(Row(s["metric"], er, str(s.get("alternative") or "—"), num(s.get("alt_value")),
                        str(s.get("unit") or ""), num(s.get("ratio")), str(s.get("device") or "cpu"),
                        str(s.get("command") or ""), b.name))
    return rows


def summary_rows(inputs: Inputs) -> List[Row]:
    """Every bench's ``summary`` rows, in file order, the strongest alternative of each figure kept."""
    rows = best_alternatives([r for b in inputs.benches for r in contract_rows(b, inputs.problems)])
    benches: Dict[str, set] = {}
    for r in rows:
        benches.setdefault(r.metric, set()).add(r.bench)
    for r in rows:  # one metric name from two runs (e.g. 2 x 2 and 3 x 1 jobs): say which run
        if len(benches[r.metric]) > 1:
            r.metric = f"{r.metric} [{r.bench}]"
    return rows


def best_alternatives(rows: List[Row]) -> List[Row]:
    """One row per bench and metric: the strongest alternative (lowest ratio), saying how many there were."""
    groups: Dict[Tuple[str, str], List[Row]] = {}
    for r in rows:
        groups.setdefault((r.bench, r.metric), []).append(r)
    out = []
    for same in groups.values():
        rated = [x for x in same if x.ratio is not None]
        best = min(rated, key=lambda x: x.ratio or 0.0) if rated else same[0]
        if len(same) > 1:
            best = dataclasses.replace(best, alternative=f"{best.alternative} (strongest of {len(same)})")
        out.append(best)
    return out


def _fmt(v: Optional[float], unit: str) -> str:
    if v is None:
        return "—"
    return f"{v:.3g} {unit}".strip()


def table(rows: List[Row]) -> str:
    """The markdown summary table; a ratio above 1 (elasticrun ahead) is bold."""
    out = ["| metric | elasticrun | best alternative | ratio | device | command |", "|---|---:|---|---:|---|---|"]
    for r in rows:
        alt = r.alternative if r.alt_value is None else f"{r.alternative}: {_fmt(r.alt_value, r.unit)}"
        ratio = "—" if r.ratio is None else (f"**{r.ratio:.2f}×**" if r.ratio >= 1 else f"{r.ratio:.2f}×")
        cmd = "`" + JSON_DIR.sub(r"\1\2", r.command) + "`" if r.command else "—"
        cells = [r.metric, _fmt(r.elasticrun, r.unit), alt, ratio, r.device, cmd]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out)


def block(inputs: Inputs, rows: List[Row]) -> str:
    """What goes between the markers: provenance line, table, problems."""
    m = inputs.manifest
    host = m.get("host") or {}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(m["started"])) if num(m.get("started")) else "?"
    load = host.get("loadavg_start")
    head = (f"Generated by `scripts/perf/perf_report.py` from a `--preset {m.get('preset', '?')}` "
            f"run of `scripts/bench/run_all.py` (`--device {m.get('device', 'cpu')}`) started {when}; machine: "
            f"{host.get('cpus', '?')} CPUs"
            + (f" ({host['cpu']})" if host.get("cpu") else "")
            + (f", {host['mem_gib']} GiB" if host.get("mem_gib") else "")
            + (f", load average {load[0]} at start" if isinstance(load, list) and load else "")
            + (f", {m['loadavg_end'][0]} at end" if isinstance(m.get("loadavg_end"), list) else "") + ".")
    parts = [head, "", table(rows) if rows else "_No results._"]
    if inputs.problems:
        parts += ["", "Not in this table:", ""] + [f"- {p}" for p in inputs.problems]
    return "\n".join(parts)


def replace_block(text: str, content: str) -> str:
    """``text`` with everything between the markers replaced by ``content`` (markers kept)."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < 0 or j < i:
        raise ValueError(f"the page needs the markers {BEGIN} and {END}, in that order")
    return text[: i + len(BEGIN)] + "\n" + content.strip("\n") + "\n" + text[j:]


ER_COLOR = "#1f77b4"
ALT_COLOR = "#d62728"
TOOL_COLORS = {"elasticrun": ER_COLOR, "safetensors": "#ff7f0e", "dcp": "#2ca02c", "torch": "#9467bd",
               "disk": "grey"}


def _tool_style(name: str, k: int) -> Dict[str, Any]:
    """Line style of a checkpoint series: a colour per tool, elasticrun's variants thick, in line styles."""
    tool = next((t for t in TOOL_COLORS if name.lower().startswith(t)), "")
    extra = {"elasticrun": {"lw": 2.4, "ls": ("-", "--", "-.", ":")[k % 4]}, "disk": {"ls": "--", "lw": 1}}
    return {"color": TOOL_COLORS.get(tool), **extra.get(tool, {})}


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported when a chart is drawn: the table needs no matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def strip_chart(groups: List[Dict[str, Any]], title: str, path: Path) -> Path:
    """Per launcher/variant: each ok run a dot, the median a bar, failed or hung runs counted, phases as ticks."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 0.55 * len(groups) + 1.6))
    worst = max([t for g in groups for t in g["times"]] + [1.0])
    names = list(dict.fromkeys(n for g in groups for n, _ in g.get("phases") or []))
    palette = plt.get_cmap("Dark2")
    phase_colors = {n: palette(i % 8) for i, n in enumerate(names)}
    shown: set = set()
    for y, g in enumerate(groups):
        times = g["times"]
        color = ER_COLOR if g["label"].lower().startswith("elasticrun") else ALT_COLOR
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
    plt = _pyplot()
    from matplotlib import ticker

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


RDZV_PANELS = (  # row key, y label, guides from the smallest run of round 0: linear in the nodes, or flat and 2x
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
    """Log-log panels of ``RDZV_PANELS`` against the node count, one line per phase, round 0's guides dotted."""
    plt = _pyplot()
    from matplotlib import ticker

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
    return _save(fig, path)


STRIPS = (("recovery", "crash → first training step after recovery"), ("launch", "launch → first training step"),
          ("scaleup", "scale-up: new node's agent started → its first step in the job"))  # key and chart title


def draw_all(data: Dict[str, Any], img_dir: Path) -> List[Path]:
    """Every chart there is data for, written as ``img_dir/perf-*.png``."""
    out = [strip_chart(data[key], title, img_dir / f"perf-{key}.png") for key, title in STRIPS if data[key]]
    if data["checkpoint"]:
        out.append(checkpoint_chart(data["checkpoint"], data["device"], img_dir / "perf-checkpoint.png",
                                    data["checkpoint_note"]))
    return out + [rendezvous_chart(doc, img_dir / f"perf-{name}.png") for name, doc in data["rendezvous"].items()]


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, nargs="?", help="an output dir of scripts/bench/run_all.py")
    ap.add_argument("--page", type=Path, default=REPO / "docs" / "performance.md")
    ap.add_argument("--img-dir", type=Path, default=REPO / "docs" / "img")
    ap.add_argument("--no-plots", action="store_true", help="only the table (no matplotlib needed)")
    ap.add_argument("--no-page", action="store_true", help="do not edit the page")
    ap.add_argument("--print", action="store_true", help="print the table on stdout")
    ap.add_argument("--rendezvous", type=Path, metavar="FILE",
                    help="draw only the rendezvous-at-scale chart of bench_rendezvous.py --out FILE into -o")
    ap.add_argument("-o", "--output", type=Path, default=REPO / "docs" / "img" / "perf-rendezvous.png",
                    help="the PNG of --rendezvous")
    return ap.parse_args(argv)


def fail(message: str) -> int:
    """``message`` as one line on stderr; the exit code of bad input."""
    print(f"perf_report: {message}", file=sys.stderr)
    return 2


def draw_rendezvous(rows_file: Path, output: Path) -> int:
    """The rendezvous-at-scale chart of one ``bench_rendezvous.py --out FILE``."""
    try:
        data = json.loads(rows_file.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError("no 'rows' list")
    except (OSError, ValueError) as err:
        return fail(f"cannot read {rows_file}: {err}; give the file of bench_rendezvous.py --out")
    output.parent.mkdir(parents=True, exist_ok=True)
    print(rendezvous_chart(data, output))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.rendezvous is None and (args.results is None or not args.results.is_dir()):
        return fail(f"{args.results} is not a directory: pass the --out dir of scripts/bench/run_all.py")
    if args.rendezvous or not args.no_plots:
        try:
            _pyplot()
        except ImportError:
            return fail("the charts need matplotlib: pip install 'elasticrun[plot]' (or pass --no-plots)")
    if args.rendezvous is not None:
        return draw_rendezvous(args.rendezvous, args.output)
    inputs = load_dir(args.results)
    if not inputs.benches:
        return fail(f"no bench JSON in {args.results}: run scripts/bench/run_all.py --out {args.results} first")
    rows = summary_rows(inputs)
    content = block(inputs, rows)
    if not args.no_page:
        try:
            new = replace_block(args.page.read_text(), content)
        except (OSError, ValueError) as e:
            return fail(f"cannot update {args.page}: {getattr(e, 'strerror', None) or e}")
        args.page.write_text(new)
        print(f"perf_report: {len(rows)} rows written to {args.page}")
    if args.print:
        print(content)
    if not args.no_plots:
        args.img_dir.mkdir(parents=True, exist_ok=True)
        for path in draw_all(chart_data(inputs), args.img_dir):
            print(f"perf_report: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
