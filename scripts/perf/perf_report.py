#!/usr/bin/env python
"""Turn a ``scripts/bench/run_all.py`` output dir into the performance page: summary table + charts.

    python scripts/perf/perf_report.py /tmp/perf                        # docs/performance.md + docs/img/perf-*.png
    python scripts/perf/perf_report.py /tmp/perf --no-plots --print     # the table only, on stdout too

Reads the bench JSON files that the dir's manifest (``bench_all.json``: commands, device, machine,
failed benches) lists, or every ``*.json`` of a dir without one. A bench's rows come from the
``"summary"`` list of its JSON (``metric, elasticrun, alternative, alt_value, unit, better,
ratio, device, command``); a bench without one (an older JSON shape) gets rows derived from its
raw results where that is possible.
A missing, unreadable or failed bench is listed under the table, never fatal. The markdown table
replaces what lies between ``<!-- summary:begin -->`` and ``<!-- summary:end -->`` in the page,
so reruns update the page in place. Charts (``perf-recovery``, ``perf-checkpoint``,
``perf-rendezvous``, ``perf-scaleup``) need matplotlib: ``pip install 'elasticrun[plot]'``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
BEGIN = "<!-- summary:begin -->"
END = "<!-- summary:end -->"
MANIFEST = "bench_all.json"
JSON_DIR = re.compile(r"--json([ =])[^ ]*/")

sys.path.insert(0, str(HERE))  # perf_data, perf_charts: also when loaded by path
from perf_data import (  # noqa: E402
    Bench,
    Inputs,
    chart_data,
    checkpoint_series,
    ckpt_op,
    elastic_groups,
    kind_of,
    launch_groups,
    median_or_none,
    num,
    records,
    rendezvous_points,
)

__all__ = ["Bench", "Inputs", "Row", "chart_data", "load_dir", "main", "records", "summary_rows", "table"]


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


def load_dir(d: Path) -> Inputs:
    """Read the manifest and every bench JSON of ``d``; problems are collected, not raised."""
    problems: List[str] = []
    manifest: Dict[str, Any] = {}
    mpath = d / MANIFEST
    if mpath.exists():
        try:
            manifest = json.loads(mpath.read_text())
        except ValueError as e:
            problems.append(f"{MANIFEST}: not JSON ({e})")
    entries = {str(e.get("json") or f"{e.get('name')}.json"): e for e in manifest.get("benches", [])
               if isinstance(e, dict)}
    for e in entries.values():
        if e.get("status") not in (None, "ok"):
            why = "; ".join(e.get("notes") or []) or f"exit code {e.get('returncode')}"
            problems.append(f"{e.get('name')}: {e.get('status')} ({why})")
    benches: List[Bench] = []
    listed = [d / str(e["json"]) for e in entries.values() if e.get("json")]
    for p in listed:
        if not p.exists():
            problems.append(f"{p.name}: listed in {MANIFEST} but missing")
    files = [p for p in listed if p.exists()] if "benches" in manifest else sorted(d.glob("*.json"))
    for p in files:  # a manifest decides which files belong to the run (older files in the dir are not read)
        if p.name == MANIFEST:
            continue
        e = entries.get(p.name, {})
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as err:
            problems.append(f"{p.name}: unreadable ({err.__class__.__name__})")
            continue
        dev = data.get("device") if isinstance(data, dict) and isinstance(data.get("device"), str) else None
        benches.append(Bench(p.stem, kind_of(p.stem, str(e.get("script", ""))), data, str(e.get("command") or ""),
                             dev or str(manifest.get("device") or "cpu")))
    return Inputs(benches, manifest, problems)


def contract_rows(b: Bench, problems: List[str]) -> Optional[List[Row]]:
    """The bench's own ``summary`` list, validated; None when it has none."""
    summary = b.data.get("summary") if isinstance(b.data, dict) else None
    if not isinstance(summary, list):
        return None
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


def _best_vs(groups: Dict[Tuple[str, str], Tuple[List[float], int]], scenario: str, metric: str,
             b: Bench) -> Optional[Row]:
    mine = {k[1]: v for k, v in groups.items() if k[0] == scenario}
    er = {n: median_or_none(t) for n, (t, _) in mine.items() if n.startswith("elasticrun") and t}
    alt = {n: median_or_none(t) for n, (t, _) in mine.items() if not n.startswith("elasticrun") and t}
    if not er:
        return None
    er_name = min(er, key=lambda n: er[n])  # type: ignore[arg-type,return-value]
    alt_name = min(alt, key=lambda n: alt[n]) if alt else ""  # type: ignore[arg-type,return-value]
    ok = f"{len(mine[er_name][0])}/{mine[er_name][1]} ok"
    label = f"{metric} ({er_name}, {ok})" if er_name != "elasticrun" else f"{metric} ({ok})"
    alt_label = f"{alt_name} ({len(mine[alt_name][0])}/{mine[alt_name][1]} ok)" if alt_name else "— (none succeeded)"
    return Row(label, er[er_name], alt_label, alt.get(alt_name), "s", "lower",
               ratio_of(er[er_name], alt.get(alt_name), "lower"), b.device, b.command)


def checkpoint_rows(b: Bench) -> List[Row]:
    """Save, fresh load and in-place load of an older checkpoint JSON: elasticrun against the fastest other tool."""
    series = checkpoint_series(b.data)
    size = num(b.data.get("size_bytes")) if isinstance(b.data, dict) else None
    gb = f", {size / 1e9:.2f} GB" if size else ""
    rows = []
    for op, metric in (("save", "durable checkpoint save"), ("load", "cold checkpoint load, fresh tensors"),
                       ("load-into", "cold checkpoint load into existing tensors")):
        er = {k: v for k, v in series.items() if ckpt_op(k) == ("elasticrun", op)}
        alts = {k: v for k, v in series.items() if ckpt_op(k)[0] not in ("elasticrun", "disk")
                and ckpt_op(k)[1] in ((op,) if op == "save" else ("load", "load-into"))}
        if not er:
            continue
        e = min(er.values())
        a = min(alts, key=lambda k: alts[k]) if alts else ""
        rows.append(Row(metric + gb, e, ckpt_op(a)[0] if a else "—", alts.get(a), "s", "lower",
                        ratio_of(e, alts.get(a), "lower"),
                        b.device, b.command))
    return rows


def derived_rows(b: Bench) -> List[Row]:
    """Rows for a bench JSON without a ``summary`` list (older shapes)."""
    if b.kind == "launch":
        g = launch_groups(b.data)
        return [r for sc, m in (("launch", "launch → first step"), ("restart", "worker crash → first step"))
                for r in [_best_vs(g, sc, m, b)] if r]
    if b.kind == "elastic":
        g = elastic_groups(b.data)
        pairs = (("kill", "node killed → first step at the smaller world"),
                 ("join", "node started → its first step in the job"))
        return [r for sc, m in pairs for r in [_best_vs(g, sc, m, b)] if r]
    if b.kind == "checkpoint":
        return checkpoint_rows(b)
    if b.kind == "rendezvous":
        pts = rendezvous_points(b.data)
        if pts:
            n = max(pts)
            return [Row(f"rendezvous of {n} agents, one etcd ({b.name})", pts[n], "—", None, "s", "lower", None,
                        b.device, b.command)]
    if b.kind == "snapshot" and isinstance(b.data, dict):
        stall = num(b.data.get("snapshot_async_stall_s"))
        mib = (num(b.data.get("bytes")) or 0) / (1 << 20)
        if stall is not None:
            return [Row(f"async memory snapshot: training stall, {mib:.0f} MiB", stall, "—", None, "s", "lower",
                        None, b.device, b.command)]
    return []


def summary_rows(inputs: Inputs) -> List[Row]:
    """Every bench's rows, in file order: the contract's list where there is one, derived otherwise."""
    rows: List[Row] = []
    for b in inputs.benches:
        own = contract_rows(b, inputs.problems)
        for r in own if own is not None else derived_rows(b):
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
        cmd = "`" + JSON_DIR.sub(r"--json\1", r.command) + "`" if r.command else "—"  # no temp dirs in the page
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
