#!/usr/bin/env python
"""Turn a ``scripts/bench/run_all.py`` output dir into the performance page: summary table + charts.

    python scripts/perf/perf_report.py /tmp/perf                        # docs/performance.md + docs/img/perf-*.png
    python scripts/perf/perf_report.py /tmp/perf --no-plots --print     # the table only, on stdout too

Reads the bench JSON files that the dir's manifest (``bench_all.json``: commands, device, machine,
failed benches) lists, or every ``*.json`` of a dir without one. The rows are the ``"summary"`` list
of each bench's JSON (``metric, elasticrun, alternative, alt_value, unit, better, ratio, device,
command``). A missing, unreadable or failed bench is listed under the table, never fatal. The table
replaces what lies between ``<!-- summary:begin -->`` and ``<!-- summary:end -->`` in the page, so
reruns update it in place. The charts (``perf-launch``, ``perf-recovery``, ``perf-checkpoint``,
``perf-rendezvous``, ``perf-scaleup``) need matplotlib: ``pip install 'elasticrun[plot]'``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
BEGIN = "<!-- summary:begin -->"
END = "<!-- summary:end -->"
JSON_DIR = re.compile(r"(--json|--out)([ =])[^ ]*/")  # where run_all put a bench's JSON: not on the page

sys.path.insert(0, str(HERE))  # perf_data, perf_charts: also when loaded by path
from perf_data import Bench, Inputs, chart_data, load_dir, num  # noqa: E402

__all__ = ["Bench", "Inputs", "Row", "chart_data", "load_dir", "main", "summary_rows", "table"]


@dataclass
class Row:
    """One line of the summary table (the bench JSON ``summary`` contract)."""

    metric: str
    elasticrun: Optional[float]
    alternative: str
    alt_value: Optional[float]
    unit: str
    better: str  # "lower" | "higher"
    ratio: Optional[float]
    device: str
    command: str
    bench: str = ""  # the file it came from (not a table column)


def ratio_of(er: Optional[float], alt: Optional[float], better: str) -> Optional[float]:
    """> 1 means elasticrun wins: alternative/elasticrun for lower-is-better, the inverse otherwise."""
    if er is None or alt is None or er <= 0 or alt <= 0:
        return None
    return alt / er if better == "lower" else er / alt


def contract_rows(b: Bench, problems: List[str]) -> List[Row]:
    """The bench's ``summary`` list, validated (what is wrong goes to ``problems``)."""
    summary = b.data.get("summary") if isinstance(b.data, dict) else None
    if not isinstance(summary, list):
        problems.append(f"{b.name}.json: no summary list")
        return []
    rows = []
    for i, s in enumerate(summary):
        er = num(s.get("elasticrun")) if isinstance(s, dict) else None
        if not isinstance(s, dict) or not isinstance(s.get("metric"), str) or er is None:
            problems.append(f"{b.name}.json: summary[{i}] lacks a metric name or a numeric elasticrun value")
            continue
        better = s.get("better") if s.get("better") in ("lower", "higher") else "lower"
        alt = num(s.get("alt_value"))
        ratio = num(s.get("ratio"))
        rows.append(Row(s["metric"], er, str(s.get("alternative") or "—"), alt, str(s.get("unit") or ""), better,
                        ratio if ratio is not None else ratio_of(er, alt, better),
                        str(s.get("device") or b.device), str(s.get("command") or b.command)))
    return rows


def summary_rows(inputs: Inputs) -> List[Row]:
    """Every bench's ``summary`` rows, in file order."""
    rows: List[Row] = []
    for b in inputs.benches:
        for r in contract_rows(b, inputs.problems):
            r.bench = b.name
            rows.append(r)
    rows = best_alternatives(rows)
    benches: Dict[str, set] = {}
    for r in rows:
        benches.setdefault(r.metric, set()).add(r.bench)
    for r in rows:  # one metric name from two runs (e.g. 2 x 2 and 3 x 1 jobs): say which run
        if len(benches[r.metric]) > 1:
            r.metric = f"{r.metric} [{r.bench}]"
    return rows


def best_alternatives(rows: List[Row]) -> List[Row]:
    """One row per bench, metric and device: a bench that compares one figure with several
    alternatives keeps the strongest one (the lowest ratio), named with how many there were."""
    groups: Dict[Tuple[str, str, str], List[Row]] = {}
    for r in rows:
        groups.setdefault((r.bench, r.metric, r.device), []).append(r)
    out = []
    for r in rows:
        same = groups.pop((r.bench, r.metric, r.device), None)
        if same is None:
            continue
        rated = [x for x in same if x.ratio is not None]
        best = min(rated, key=lambda x: x.ratio) if rated else same[0]  # type: ignore[arg-type,return-value]
        if len(same) > 1:
            best = Row(**dict(best.__dict__, alternative=f"{best.alternative} (strongest of {len(same)})"))
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


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="an output dir of scripts/bench/run_all.py")
    ap.add_argument("--page", type=Path, default=REPO / "docs" / "performance.md")
    ap.add_argument("--img-dir", type=Path, default=REPO / "docs" / "img")
    ap.add_argument("--no-plots", action="store_true", help="only the table (no matplotlib needed)")
    ap.add_argument("--no-page", action="store_true", help="do not edit the page")
    ap.add_argument("--print", action="store_true", help="print the table on stdout")
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if not args.results.is_dir():
        print(f"perf_report: {args.results} is not a directory: pass the --out dir of scripts/bench/run_all.py",
              file=sys.stderr)
        return 2
    charts = None
    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("perf_report: the charts need matplotlib: pip install 'elasticrun[plot]' (or pass --no-plots)",
                  file=sys.stderr)
            return 2
        import perf_charts as charts  # type: ignore[no-redef]
    inputs = load_dir(args.results)
    if not inputs.benches:
        print(f"perf_report: no bench JSON in {args.results}: run scripts/bench/run_all.py --out {args.results} first",
              file=sys.stderr)
        return 2
    rows = summary_rows(inputs)
    content = block(inputs, rows)
    if not args.no_page:
        try:
            new = replace_block(args.page.read_text(), content)
        except (OSError, ValueError) as e:
            print(f"perf_report: cannot update {args.page}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
            return 2
        args.page.write_text(new)
        print(f"perf_report: {len(rows)} rows written to {args.page}")
    if args.print:
        print(content)
    if charts is not None:
        args.img_dir.mkdir(parents=True, exist_ok=True)
        for path in charts.draw_all(chart_data(inputs), args.img_dir):
            print(f"perf_report: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
