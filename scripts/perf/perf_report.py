"""Turn a ``scripts/bench/run_all.py`` output dir into the performance page: summary table + charts.

    python scripts/perf/perf_report.py /tmp/perf                        # docs/performance.md + docs/img/perf-*.png
    python scripts/perf/perf_report.py /tmp/perf --no-plots --print     # the table only, on stdout too
    python scripts/perf/perf_report.py --rendezvous rdzv.json -o docs/img/perf-rendezvous.png

The table (the ``"summary"`` rows of the bench JSON files that the dir's ``bench_all.json`` lists) replaces what
lies between the page's summary markers. The charts need matplotlib: ``pip install 'elasticrun[plot]'``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
if str(HERE) not in sys.path:  # plot_job.py beside this file, also when a test loads this one by path
    sys.path.insert(0, str(HERE))

from plot_job import pyplot, save  # noqa: E402 - from beside this file (above)

BEGIN = "<!-- summary:begin -->"
END = "<!-- summary:end -->"
JSON_DIR = re.compile(r"(--json|--out)([ =])[^ ]*/")  # where run_all put a bench's JSON: not on the page
MANIFEST = "bench_all.json"
SCENARIOS = {"restart": "worker crash", "kill": "node SIGKILL", "join": "node joins", "leave": "node leaves",
             "launch": "1 node", "launch-multi": "several nodes"}  # chart labels
CKPT_OPS = ((" save (durable)", "save"), (" load into existing tensors (cold)", "load"))  # ckpt_compare's labels
Row = Dict[str, Any]  # an entry of a bench JSON's "summary" list, plus "bench": the file's stem


@dataclass
class Inputs:
    benches: List[Tuple[str, str, Dict[str, Any]]]  # name (the file's stem), kind (launch, ...: its script's), data
    manifest: Dict[str, Any]
    problems: List[str]  # what is not in the table, and why


def load_dir(d: Path) -> Inputs:
    """The run's manifest, the bench JSON files it lists, and what failed or is missing."""
    manifest = json.loads((d / MANIFEST).read_text())
    inputs = Inputs([], manifest, [])
    for e in manifest["benches"]:
        if e["status"] != "ok":
            why = "; ".join(e["notes"]) or f"exit code {e['returncode']}"
            inputs.problems.append(f"{e['name']}: {e['status']} ({why})")
    for e in (e for e in manifest["benches"] if e["json"]):
        try:
            data = json.loads((d / e["json"]).read_text())
        except FileNotFoundError:
            inputs.problems.append(f"{e['json']}: listed in {MANIFEST} but missing")
        except (OSError, ValueError) as err:
            inputs.problems.append(f"{e['json']}: unreadable ({err.__class__.__name__})")
        else:
            inputs.benches.append((Path(e["json"]).stem, Path(e["script"]).stem.replace("bench_", ""), data))
    return inputs


def scenario_label(scenario: str) -> str:
    """A chart label for a scenario key: ``restart@1s`` → ``worker crash at 1s``."""
    base, _, at = scenario.partition("@")
    return SCENARIOS.get(base, base) + (f" at {at}" if at else "")


Point = Tuple[str, str, str, Tuple[float, float]]  # (op, tool, state/device tag, (GB, GB/s))


def launch_items(data: Dict[str, Any]) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """bench_launch's strip-chart items, with their chart (``launch`` or ``recovery``): per scenario and
    launcher, its ok runs' seconds and the phases of the median one."""
    groups: Dict[Tuple[str, str], List[dict]] = {}
    for r in data["runs"]:  # a crash at a set moment of the round is a scenario of its own
        at = "" if r["crash_after"] is None else f"@{r['crash_after']:g}s"
        groups.setdefault((r["scenario"] + at, r["launcher"]), []).append(r)
    for (scenario, who), runs in groups.items():
        ok = sorted((r for r in runs if r["outcome"] == "ok"), key=lambda r: r["seconds"])
        phases = sorted(ok[len(ok) // 2]["phases"].items(), key=lambda kv: kv[1]) if ok else []
        yield ("launch" if scenario.startswith("launch") else "recovery",
               {"label": f"{who} · {scenario_label(scenario)}", "times": [r["seconds"] for r in ok],
                "runs": len(runs), "phases": phases})


def elastic_items(name: str, data: Dict[str, Any]) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """bench_elastic's strip-chart items (``scaleup`` for a join, else ``recovery``), per variant and scenario."""
    run = "" if name == "elastic" else f" ({name})"  # e.g. elastic-join3: another job shape
    for s in data["results"]:
        yield ("scaleup" if s["scenario"] == "join" else "recovery",
               {"label": f"{s['variant']} · {s['client']} client · {scenario_label(s['scenario'])}{run}",
                "times": [o["seconds"] for o in s["outcomes"] if o["status"] == "ok"],
                "runs": len(s["outcomes"]), "phases": []})


def checkpoint_points(data: Dict[str, Any]) -> Iterator[Point]:
    """bench_checkpoint's throughput points, tagged with a non-uniform state or a GPU."""
    comp, size = data["compare"], data["compare"]["size_bytes"] / 1e9
    tag = ", ".join(str(comp[k]) for k in ("state", "device") if comp[k] not in ("uniform", "cpu"))
    for label, secs in comp["runs"].items():
        found = [(op, label[: -len(suffix)]) for suffix, op in CKPT_OPS if label.endswith(suffix)]
        if label.startswith("disk: cold"):
            found = [("load", "disk: cold read")]
        if found and secs:
            yield (*found[0], f" [{tag}]" if tag else "", (size, size / statistics.median(secs)))


def chart_data(inputs: Inputs) -> Dict[str, Any]:
    """Plain data for the charts: strip-chart items (per launcher or variant and scenario: its ok runs' seconds and
    the phases of the median one), checkpoint throughput (GB, GB/s) by op and tool, tagged with a non-uniform state
    or a GPU where the files differ in it, rendezvous runs."""
    out: Dict[str, Any] = {"recovery": [], "launch": [], "scaleup": [], "checkpoint": {}, "rendezvous": {},
                           "device": inputs.manifest["device"]}
    points: List[Point] = []
    for name, kind, data in inputs.benches:
        if kind in ("launch", "elastic"):
            for chart, item in launch_items(data) if kind == "launch" else elastic_items(name, data):
                out[chart].append(item)
        elif kind == "checkpoint":
            points.extend(checkpoint_points(data))
        elif kind == "rendezvous" and data["rows"]:
            out["rendezvous"][name] = data
    tags = {tag for _, _, tag, _ in points}
    for op, tool, tag, pt in points:
        out["checkpoint"].setdefault(op, {}).setdefault(tool + (tag if len(tags) > 1 else ""), []).append(pt)
    out["checkpoint_note"] = next(iter(tags)).strip(" []") if len(tags) == 1 else ""
    return out


def summary_rows(inputs: Inputs) -> List[Row]:
    """Every bench's ``summary`` rows in file order, one per bench and metric: the strongest alternative (lowest
    ratio), saying how many there were; a metric name that two benches give says which bench it is."""
    groups: Dict[Tuple[str, str], List[Row]] = {}
    for name, _, data in inputs.benches:  # each entry made by scripts/bench/common.py's summary_row
        if not isinstance(data.get("summary"), list):
            inputs.problems.append(f"{name}.json: no summary list")
            continue
        for s in data["summary"]:
            groups.setdefault((name, s["metric"]), []).append(dict(s, bench=name))
    benches = Counter(metric for _, metric in groups)  # e.g. the same figure of 2 x 2 and 3 x 1 jobs
    rows = []
    for (bench, metric), same in groups.items():
        rated = [x for x in same if x["ratio"] is not None]
        rows.append(dict(min(rated, key=lambda x: x["ratio"]) if rated else same[0]))
        rows[-1]["alternative"] += f" (strongest of {len(same)})" if len(same) > 1 else ""
        rows[-1]["metric"] += f" [{bench}]" if benches[metric] > 1 else ""
    return rows


def _fmt(v: Optional[float], unit: str) -> str:
    return "—" if v is None else f"{v:.3g} {unit}".strip()


def table(rows: List[Row]) -> str:
    """The markdown summary table; a ratio above 1 (elasticrun ahead) is bold."""
    out = ["| metric | elasticrun | best alternative | ratio | device | command |", "|---|---:|---|---:|---|---|"]
    for r in rows:
        alt = r["alternative"] + ("" if r["alt_value"] is None else f": {_fmt(r['alt_value'], r['unit'])}")
        ratio = "—" if r["ratio"] is None else (f"**{r['ratio']:.2f}×**" if r["ratio"] >= 1 else f"{r['ratio']:.2f}×")
        cmd = "`" + JSON_DIR.sub(r"\1\2", r["command"]) + "`" if r["command"] else "—"
        cells = [r["metric"], _fmt(r["elasticrun"], r["unit"]), alt, ratio, r["device"], cmd]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out)


def block(inputs: Inputs, rows: List[Row]) -> str:
    """What goes between the markers: provenance line, table, problems."""
    m, host = inputs.manifest, inputs.manifest["host"]
    head = (f"Generated by `scripts/perf/perf_report.py` from a `--preset {m['preset']}` run of "
            f"`scripts/bench/run_all.py` (`--device {m['device']}`) started "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(m['started']))}; machine: {host['cpus']} CPUs"
            + (f" ({host['cpu']})" if host.get("cpu") else "")
            + (f", {host['mem_gib']} GiB" if host.get("mem_gib") else "")
            + f", load average {host['loadavg_start'][0]} at start"
            + (f", {m['loadavg_end'][0]} at end" if "loadavg_end" in m else "") + ".")
    parts = [head, "", table(rows) if rows else "_No results._"]
    if inputs.problems:
        parts += ["", "Not in this table:", ""] + [f"- {p}" for p in inputs.problems]
    return "\n".join(parts)


def replace_block(text: str, content: str) -> str:
    """``text`` with everything between the markers replaced by ``content`` (markers kept)."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"the page needs the markers {BEGIN} and {END}, in that order")
    return text[: i + len(BEGIN)] + "\n" + content.strip("\n") + "\n" + text[j:]


ER_COLOR = "#1f77b4"
ALT_COLOR = "#d62728"
TOOL_COLORS = {"elasticrun": ER_COLOR, "safetensors": "#ff7f0e", "dcp": "#2ca02c", "torch": "#9467bd",
               "disk": "grey"}


def strip_chart(groups: List[Dict[str, Any]], title: str, path: Path) -> Path:
    """Per launcher/variant: each ok run a dot, the median a bar, failed or hung runs counted, phases as ticks."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 0.55 * len(groups) + 1.6))
    worst = max([t for g in groups for t in g["times"]] + [1.0])
    names = list(dict.fromkeys(n for g in groups for n, _ in g["phases"]))
    phase_colors = {n: plt.get_cmap("Dark2")(i % 8) for i, n in enumerate(names)}
    shown: set = set()
    for y, g in enumerate(groups):
        times = g["times"]
        color = ER_COLOR if g["label"].lower().startswith("elasticrun") else ALT_COLOR
        if times:
            med = statistics.median(times)
            ax.barh(y, med, color=color, alpha=0.25, height=0.6)
            ax.plot(times, [y] * len(times), "o", color=color, ms=5)
            ax.text(med, y + 0.32, f" {med:.2f} s", va="bottom", fontsize=8)
        for name, t in g["phases"]:
            ax.plot([t, t], [y - 0.32, y + 0.32], color=phase_colors[name], lw=2.2,
                    label=name if name not in shown else None)
            shown.add(name)
        if g["runs"] > len(times):
            ax.text(worst * 1.02, y, f"{g['runs'] - len(times)}/{g['runs']} failed or hung", va="center", fontsize=8,
                    color=ALT_COLOR)
    ax.set_yticks(range(len(groups)), [g["label"] for g in groups], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlim=(0, worst * 1.35), xlabel="seconds (dots: runs; bar: median)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    if names:
        ax.legend(title="phases (median run)", fontsize=7, title_fontsize=7, loc="lower right")
    return save(fig, path)


def checkpoint_chart(data: Dict[str, Dict[str, List[Tuple[float, float]]]], device: str, path: Path,
                     note: str = "") -> Path:
    """Throughput (GB/s) against state size, one panel per operation, one line per tool/variant: a colour per tool,
    elasticrun's variants thick in line styles of their own."""
    plt = pyplot()
    ops = [op for op in ("save", "load") if op in data]
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        er = 0
        for name, pts in sorted(data[op].items()):
            tool = next((t for t in TOOL_COLORS if name.lower().startswith(t)), "")
            style = {"elasticrun": {"lw": 2.4, "ls": ("-", "--", "-.", ":")[er % 4]}, "disk": {"ls": "--", "lw": 1}}
            er += name.startswith("elasticrun")
            ax.plot(*zip(*sorted(pts)), marker="o", label=name, color=TOOL_COLORS.get(tool), **style.get(tool, {}))
        sizes = sorted({p[0] for pts in data[op].values() for p in pts})
        ax.set(xscale="log", xticks=sizes, xlim=(sizes[0] / 1.6, sizes[-1] * 1.6), ylim=(0, None),
               xlabel="state size (GB)", ylabel="GB/s (higher is better)")
        ax.xaxis.set_major_formatter(plt.FormatStrFormatter("%.2g"))
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
        how = "durable" if op == "save" else "cold page cache"
        ax.set_title(f"checkpoint {op} ({', '.join(x for x in (note, device, how) if x)})", fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="best")
    return save(fig, path)


RDZV_PANELS = (  # row key, y label, guides from the smallest run of round 0: linear in the nodes, or flat and 2x
    ("all_hold_s", "seconds until every agent holds the round", "linear"),
    ("cpu_per_agent_ms", "agents' CPU per agent (ms)", "flat"),
    ("etcd_cpu_s", "etcd CPU per round (s)", "linear"),
    ("etcd_writes", "etcd writes per round", "linear"),
)
RDZV_PHASES = {"round 0": "round 0 (all register)", "loss": "re-form after a node is SIGKILLed",
               "join": "re-form after a node joins"}


def rendezvous_chart(data: Dict[str, Any], path: Path) -> Path:
    """Log-log panels of ``RDZV_PANELS`` against the node count, one line per phase (the median where a size ran
    more than once; failed rows left out), round 0's guides dotted."""
    plt, rows = pyplot(), data["rows"]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    for ax, (key, label, guide) in zip(axes.flat, RDZV_PANELS):
        by: Dict[str, Dict[int, List[float]]] = {}
        for r in rows:
            if "failed" not in r and isinstance(r.get(key), (int, float)):
                by.setdefault(str(r["phase"]), {}).setdefault(int(r["nodes"]), []).append(float(r[key]))
        for phase, pts in by.items():
            ns, ys = sorted(pts), [statistics.median(pts[n]) for n in sorted(pts)]
            ax.plot(ns, ys, marker="o", label=RDZV_PHASES.get(phase, phase))
            if phase == "round 0" and ys[0] > 0:
                for k in ((1,) if guide == "linear" else (1, 2)):
                    ax.plot(ns, [k * ys[0] * (n / ns[0] if guide == "linear" else 1) for n in ns], ls=":",
                            color="grey", lw=1)
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="nodes (simulated agents)")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(plt.FuncFormatter(lambda v, _pos: f"{v:g}"))
            axis.set_minor_formatter(plt.NullFormatter())
        ax.set_ylabel(label, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes.flat[0].plot([], [], ls=":", color="grey", label="linear in the nodes / flat and 2× (round 0)")
    axes.flat[0].legend(fontsize=7)
    failed = sorted({f"{r['nodes']} ({r['phase']})" for r in rows if "failed" in r})
    loads = [r["load"] for r in rows]
    fig.suptitle(f"Rendezvous at scale — SIMULATED: all agents on one {data['cpus']}-core machine with one etcd"
                 + (f"; did not complete: {', '.join(failed)}" if failed else "")
                 + f"\nload average {min(loads):.0f}–{max(loads):.0f} on the shared machine during the run",
                 fontsize=10)
    fig.text(0.5, 0.005, data["command"], ha="center", fontsize=7, family="monospace")
    return save(fig, path)


def draw_all(data: Dict[str, Any], img_dir: Path) -> List[Path]:
    """Every chart there is data for, written as ``img_dir/perf-*.png``."""
    strips = {"recovery": "crash → first training step after recovery", "launch": "launch → first training step",
              "scaleup": "scale-up: new node's agent started → its first step in the job"}
    out = [strip_chart(data[key], title, img_dir / f"perf-{key}.png") for key, title in strips.items() if data[key]]
    if data["checkpoint"]:
        out.append(checkpoint_chart(data["checkpoint"], data["device"], img_dir / "perf-checkpoint.png",
                                    data["checkpoint_note"]))
    return out + [rendezvous_chart(doc, img_dir / f"perf-{name}.png") for name, doc in data["rendezvous"].items()]


def fail(message: str) -> int:
    """``message`` as one line on stderr; the exit code of bad input."""
    print(f"perf_report: {message}", file=sys.stderr)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
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
    args = ap.parse_args(argv)
    if args.rendezvous is None and args.results is None:
        ap.error("give the --out dir of scripts/bench/run_all.py, or --rendezvous FILE")
    if args.rendezvous or not args.no_plots:
        try:
            pyplot()
        except ImportError:
            return fail("the charts need matplotlib: pip install 'elasticrun[plot]' (or pass --no-plots)")
    if args.rendezvous:
        try:
            data = json.loads(args.rendezvous.read_text())
            if not data.get("rows"):
                raise ValueError("no 'rows'")
        except (OSError, ValueError, AttributeError) as err:
            return fail(f"cannot read {args.rendezvous}: {err}; give the file of bench_rendezvous.py --out")
        args.output.parent.mkdir(parents=True, exist_ok=True)
        print(rendezvous_chart(data, args.output))
        return 0
    try:
        inputs = load_dir(args.results)
    except (OSError, ValueError, KeyError) as err:
        why = getattr(err, "strerror", None) or f"{err.__class__.__name__}: {err}"
        return fail(f"cannot read {args.results / MANIFEST} ({why}): give the --out dir of scripts/bench/run_all.py")
    if not inputs.benches:
        return fail(f"no bench JSON in {args.results}: run scripts/bench/run_all.py --out {args.results} first")
    rows = summary_rows(inputs)
    content = block(inputs, rows)
    if not args.no_page:
        try:
            args.page.write_text(replace_block(args.page.read_text(), content))
        except (OSError, ValueError) as e:
            return fail(f"cannot update {args.page}: {getattr(e, 'strerror', None) or e}")
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
