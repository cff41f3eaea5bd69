"""Launch and restart latency: elasticrun against torchrun (c10d) on the same worker and machine.

    python scripts/bench/bench_launch.py --runs 5 --nodes 2 --procs 2 [--json out.json]
    python scripts/bench/bench_launch.py --scenarios launch,launch-multi --launchers elasticrun,torchrun-best

Scenarios: ``launch`` (one node, ``--standalone``), ``launch-multi`` (``--nodes`` agents on torchrun's c10d line),
``restart`` (a worker crashes at step 3 or ``--crash-after`` s). docs/performance.md describes the figures.
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import os
import re
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import psutil
from common import STEP, TORCHRUN_TUNED_CONF, Agents, AgentsExited, md_table, shown_command, summary_row, write_json

from elasticrun.launch.gpus import visible_gpu_count
from elasticrun.store.server import EtcdServer, free_port

WORKER = [str(Path(__file__).resolve().parent / "elastic_worker.py"), "launch"]
CRASH = re.compile(r"bench-crash t=(?P<t>[\d.]+)")
FIRST_LINE = re.compile(r"bench-start t=(?P<t>[\d.]+)")
# elasticrun's agent lines: <ISO time>Z elasticrun[node]: <message>
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z elasticrun\[")
# torchrun's INFO lines (glog style, local time): I<MMDD> <HH:MM:SS.micro> <pid> <file:line>] <message>
TORCHRUN_FORMED = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d:\d\d:\d\d)(\.\d+) .*Rendezvous complete for workers")
# elasticrun's milestones in its agents' lines, each at the first such line of all agents or the last one
MILESTONES = [
    ("etcd up", re.compile(r"started a private etcd|hosting the job's etcd"), "first"),
    ("all nodes joined", re.compile(r"joined job "), "last"),
    ("round formed", re.compile(r"round 0 \(Start\)"), "first"),
    ("workers started", re.compile(r"round 0: workers started"), "last"),
]
ONE_MEMBER = "elasticrun-etcd1"  # elasticrun whose hosted etcd stays one member (--rdzv-conf etcd_members=1)
LAUNCHERS = ["elasticrun", "torchrun-default", "torchrun-best"]
SCENARIOS = ("launch", "launch-multi", "restart")
CRASH_STEP = 3  # restart scenario without --crash-after: the last rank crashes at this step
# The launch scenarios' extra figures: Run field → (metric, unit, table format), each lower-is-better.
LAUNCH_FIGURES = {
    "first_line": ("launch -> the script's first line", "s", ".2f"),
    "fork_wait": ("round formed -> the first worker's first line (first fork's wait)", "s", ".3f"),
    "agent_rss_mib": ("agent RSS while the workers run", "MiB", ".0f"),
}


@dataclass
class Run:
    """One measured run; ``seconds``: to the measured step, ``first_line``: to the first worker's first line,
    ``fork_wait``: the round forming → that line, ``phases``: elasticrun's milestones."""

    launcher: str
    scenario: str
    outcome: str  # ok | fail | hang
    seconds: Optional[float] = None
    note: str = ""
    crash_after: Optional[float] = None  # restart scenario: the crash's moment (s after the script started)
    phases: Dict[str, float] = field(default_factory=dict)
    device: str = "cpu"
    first_line: Optional[float] = None
    fork_wait: Optional[float] = None
    agent_rss_mib: Optional[float] = None  # the largest launcher process's RSS while the workers ran


def label(r: Run) -> str:
    """The scenario as tables show it: ``restart@1s`` for a crash 1 s into the round."""
    return r.scenario if r.crash_after is None else f"{r.scenario}@{r.crash_after:g}s"


def _figure(runs: List[Run], name: str) -> List[float]:
    """The values of field ``name`` in the ok runs that have one (``seconds``: only non-zero ones)."""
    values = (getattr(r, name) for r in runs if r.outcome == "ok")
    return [v for v in values if v is not None and (v or name != "seconds")]


def _against_torchrun(mine: List[Run], name: str, timeout: Optional[float]) -> Optional[Tuple[float, str, float, int]]:
    """elasticrun's median of ``name``, the lowest torchrun median with its note, and elasticrun's run count; None
    without both. With a ``timeout``, a torchrun with no good run counts as that (a lower bound) and says so."""
    ours = _figure([r for r in mine if r.launcher == "elasticrun"], name)
    alts = []
    for launcher in dict.fromkeys(r.launcher for r in mine if r.launcher != "elasticrun"):
        theirs = [r for r in mine if r.launcher == launcher]
        good = _figure(theirs, name)
        if timeout is not None:
            note = f"{launcher} ({len(good)}/{len(theirs)} ok{'' if good else ', timeout as lower bound'})"
            alts.append((statistics.median(good) if good else timeout, note))
        elif good:
            alts.append((statistics.median(good), f"{launcher} ({len(good)} runs)"))
    if not ours or not alts:
        return None
    alt_value, alt = min(alts)
    return statistics.median(ours), alt, alt_value, len(ours)


def summary_rows(runs: List[Run], procs: int, nodes: int, timeout: float, command: str,
                 device: str = "cpu") -> List[Dict]:
    """The JSON ``summary``: per scenario and crash moment, elasticrun's median s against the best torchrun's (launch:
    with ``delta_s``, elasticrun minus it, then :data:`LAUNCH_FIGURES`)."""
    rows: List[Dict] = []
    for name in dict.fromkeys(label(r) for r in runs):
        mine, (scenario, _, moment) = [r for r in runs if label(r) == name], name.partition("@")
        shape = f"1 x {procs}, --standalone" if scenario == "launch" else f"{nodes} x {procs}, c10d"
        metric = (f"worker crash ({moment or f'step {CRASH_STEP}'} into the round) -> first step, {nodes} x {procs}"
                  if scenario == "restart" else f"launch -> first step, {shape}")
        found = _against_torchrun(mine, "seconds", timeout)
        if found is None:
            continue
        value, alt, alt_value, count = found
        delta = {} if scenario == "restart" else {"delta_s": round(value - alt_value, 3)}
        rows.append(summary_row(metric, value, alt, alt_value, device=device, command=command, runs=count, **delta))
        for figure, (what, unit, _) in LAUNCH_FIGURES.items() if scenario != "restart" else ():
            fig = _against_torchrun(mine, figure, None)
            if fig:
                rows.append(summary_row(f"{what}, {shape}", fig[0], fig[1], fig[2], unit, device=device,
                                        command=command, runs=fig[3]))
    return rows


def summarize(runs: List[Run]) -> str:
    """A markdown table per launcher and scenario: the outcomes, median/min/max s, the medians of LAUNCH_FIGURES."""
    rows = []
    for scenario in dict.fromkeys(label(r) for r in runs):
        for launcher in dict.fromkeys(r.launcher for r in runs):
            mine = [r for r in runs if r.launcher == launcher and label(r) == scenario]
            if not mine:
                continue
            good = _figure(mine, "seconds")
            stats = [f"{f(good):.2f}" for f in (statistics.median, min, max)] if good else ["—"] * 3
            counts = [sum(r.outcome == k for r in mine) for k in ("ok", "fail", "hang")]
            extra = [format(statistics.median(values), fmt) if (values := _figure(mine, name)) else "—"
                     for name, (_, _, fmt) in LAUNCH_FIGURES.items()]
            rows.append([scenario, launcher, *counts, *stats, *extra])
    return md_table(["scenario", "launcher", "ok", "fail", "hang", "median s", "min s", "max s", "first line s",
                     "fork wait s", "agent RSS MiB"], rows)


def _times(pattern: re.Pattern, lines: List[str]) -> List[float]:
    return [float(m["t"]) for m in map(pattern.search, lines) if m]


def first_line(lines: List[str]) -> Optional[float]:
    """When the first worker script printed its first line (unix time)."""
    return min(_times(FIRST_LINE, lines), default=None)


def _stamped(lines: List[str]) -> List[Tuple[float, str]]:
    """(unix time, line) of elasticrun's agent lines."""
    found = [(m, ln) for m, ln in ((STAMP.match(ln), ln) for ln in lines) if m]
    return [(calendar.timegm(time.strptime(m[1], "%Y-%m-%dT%H:%M:%S")) + float(m[2] or 0), ln) for m, ln in found]


def round_formed(lines: List[str], launcher: str) -> Optional[float]:
    """When the first round formed (unix time), from the launcher's own log lines."""
    if launcher.startswith("elasticrun"):
        return next((t for t, line in _stamped(lines) if "round 0 (Start)" in line), None)
    m = next((m for m in map(TORCHRUN_FORMED.match, lines) if m), None)
    if m is None:
        return None
    stamp = time.strptime(f"{time.localtime().tm_year}-{m[1]}-{m[2]} {m[3]}", "%Y-%m-%d %H:%M:%S")
    return time.mktime(stamp) + float(m[4])


def launch_phases(lines: List[str], started: float, first_step: float) -> Dict[str, float]:
    """Seconds from the launch to each milestone of elasticrun's agent lines, and to the first step."""
    marks: Dict[str, float] = {}
    for t, line in _stamped(lines):
        for name, pattern, which in MILESTONES:
            if pattern.search(line) and (which == "last" or name not in marks):
                marks[name] = round(t - started, 3)
    first = first_line(lines)
    if first is not None:
        marks["first line"] = round(first - started, 3)
    marks["first step"] = round(first_step, 3)
    return marks


def agent_rss_mib(agents: Agents) -> Optional[float]:
    """The largest RSS among the launcher processes (each node's agent), in MiB."""
    sizes = []
    for p in agents.procs.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            sizes.append(psutil.Process(p.pid).memory_info().rss)
    return round(max(sizes) / 2**20, 1) if sizes else None


def _commands(launcher: str, nodes: int, procs: int, endpoint: str, job: str, c10d: bool = False) -> List[List[str]]:
    """One command per node, each allowing 3 restarts; ``c10d``: elasticrun on torchrun's c10d line too (one agent
    hosts etcd, which grows to 3 members once 3 nodes joined; ``elasticrun-etcd1``: it stays one member)."""
    program = "elasticrun" if launcher.startswith("elasticrun") else "torchrun"
    conf = ["--rdzv-conf", TORCHRUN_TUNED_CONF] if launcher == "torchrun-best" else []
    shape = ["--nproc-per-node", str(procs), "--max-restarts", "3"]
    if nodes == 1 and not endpoint:
        return [[program, "--standalone", *shape, *conf, *WORKER]]
    shape += ["--nnodes", str(nodes), "--rdzv-endpoint", endpoint, "--rdzv-id", job]
    if program == "torchrun":
        return [["torchrun", *shape, "--rdzv-backend", "c10d", *conf, *WORKER]] * nodes
    members = 1 if launcher == ONE_MEMBER else 3
    backend = ["--rdzv-backend", "c10d", "--rdzv-conf", f"etcd_members={members}"] if c10d else []
    return [["elasticrun", *shape, *backend, "--node-id", f"n{i}", *WORKER] for i in range(nodes)]


def _env(launcher: str, scenario: str, crash_after: Optional[float], device: str, once: Path) -> Dict[str, str]:
    """The workers' settings (steps, crash) and the launcher's (torchrun logs when its round formed)."""
    env = {"BENCH_STEPS": "5", "BENCH_STEP_S": "0.2", "BENCH_DEVICE": device}
    if launcher.startswith("torchrun"):
        env["LOGLEVEL"] = "INFO"
    if launcher == "torchrun-best":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if scenario == "restart" and crash_after is None:
        env.update(BENCH_CRASH_STEP=str(CRASH_STEP), BENCH_STEPS=str(CRASH_STEP + 3))
    elif scenario == "restart":
        env.update(BENCH_CRASH_AFTER_S=str(crash_after), BENCH_CRASH_ONCE_FILE=str(once),
                   BENCH_STEPS=str(int(crash_after / 0.2) + 10))
    return env


def run_once(launcher: str, scenario: str, nodes: int, procs: int, timeout: float, endpoint: str,
             crash_after: Optional[float] = None, device: str = "cpu") -> Run:
    """Start the launcher(s), wait for the step the scenario measures, then stop everything."""
    if nodes == 1:
        endpoint = ""  # --standalone for every launcher
    elif launcher.startswith("torchrun") or scenario == "launch-multi":
        endpoint = f"127.0.0.1:{free_port()}"  # a c10d store (elasticrun: etcd) hosted by one of the agents
    job = f"bench-{uuid.uuid4().hex[:8]}"
    cmds = _commands(launcher, nodes, procs, endpoint, job, c10d=scenario == "launch-multi")
    once = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_launch-{launcher}-{scenario}-{job}"  # and .log
    agents = Agents(_env(launcher, scenario, crash_after, device, once))
    started = time.time()
    for i, cmd in enumerate(cmds):
        agents.start(f"n{i}", cmd)

    def measured() -> Optional[float]:
        lines = [ln.text for ln in agents.lines()]
        if scenario != "restart":
            first = min(_times(STEP, lines), default=None)
            return None if first is None else first - started
        crash = min(_times(CRASH, lines), default=None)
        # The new attempt's first step: not "restart >= 1", as torchrun counts restarts per agent.
        after = [float(m["t"]) for m in map(STEP.search, lines) if m and m[1] == "1" and crash is not None]
        return next((t - crash for t in after if t > crash), None)

    try:
        result = agents.wait_for(measured, timeout, "the measured step")
        rss = agent_rss_mib(agents)  # the workers still run: the measured step just showed up
    except (TimeoutError, AgentsExited) as err:
        agents.close()
        lines = [ln.text for ln in agents.lines()]
        errors = " | ".join(ln for ln in lines[-200:] if "Error" in ln or "error" in ln)[-300:]
        log = once.with_suffix(".log")
        log.write_text("\n".join(lines) + "\n")
        outcome = "hang" if isinstance(err, TimeoutError) else "fail"
        return Run(launcher, scenario, outcome, None, f"{err}; log {log}; {errors}", crash_after)
    finally:
        agents.close()
        once.unlink(missing_ok=True)
    run = Run(launcher, scenario, "ok", round(result, 3), crash_after=crash_after, agent_rss_mib=rss, device=device)
    if scenario != "restart":
        lines = [ln.text for ln in agents.lines()]
        first, formed = first_line(lines), round_formed(lines, launcher)
        run.first_line = None if first is None else round(first - started, 3)
        run.fork_wait = None if first is None or formed is None else round(first - formed, 3)
        if launcher == "elasticrun":
            run.phases = launch_phases(lines, started, result)
    return run


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs per launcher and scenario")
    ap.add_argument("--nodes", type=int, default=2, help="nodes (agents on loopback) of launch-multi and restart")
    ap.add_argument("--procs", type=int, default=2, help="workers per node")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a run counts as a hang")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the workers train: cpu (gloo) or cuda (NCCL, one GPU per worker of the machine)")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS),
                    help=f"comma-separated, of {', '.join(LAUNCHERS)} and {ONE_MEMBER} (elasticrun whose c10d-line "
                         "etcd stays one member)")
    ap.add_argument("--json", help="also write every run here")
    ap.add_argument("--crash-after", default="",
                    help="restart scenario: crash the last rank this many seconds after its script started instead of "
                    "at step 3, one sub-scenario per comma-separated value (e.g. 0.2,1,3)")
    args = ap.parse_args(argv)
    args.scenarios = args.scenarios.split(",")
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        ap.error(f"--scenarios: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SCENARIOS)}")
    if args.device == "cuda":
        need, have = args.procs * (1 if args.scenarios == ["launch"] else args.nodes), visible_gpu_count()
        if have < need:  # NCCL takes one GPU per rank
            ap.error(f"--device cuda: {need} workers need {need} GPUs, this machine has {have}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Run every scenario, launcher and crash moment ``--runs`` times, interleaved; print the table."""
    args = parse_args(argv)
    runs: List[Run] = []
    moments = [float(m) for m in args.crash_after.split(",") if m.strip()] or [None]
    with (EtcdServer() if args.nodes > 1 else contextlib.nullcontext()) as etcd:  # one node: --standalone
        for scenario in args.scenarios:
            for moment in moments if scenario == "restart" else [None]:
                for i in range(args.runs):
                    for launcher in args.launchers.split(","):  # interleaved: load changes hit all alike
                        r = run_once(launcher, scenario, 1 if scenario == "launch" else args.nodes, args.procs,
                                     args.timeout, etcd.endpoint if etcd else "", moment, args.device)
                        runs.append(r)
                        print(f"{label(r):12s} run {i + 1}/{args.runs} {launcher:17s} {r.outcome:5s} "
                              f"{'' if r.seconds is None else f'{r.seconds:.2f}s'} {r.note[:160]}", flush=True)
    print(f"\nprocs per node: {args.procs}; launch-multi, restart: {args.nodes} node(s) on loopback; runs: {args.runs}")
    print(summarize(runs))
    summary = summary_rows(runs, args.procs, args.nodes, args.timeout, shown_command(__file__, argv), args.device)
    write_json(args.json, {"runs": [asdict(r) for r in runs], "summary": summary, "device": args.device})
    return 0


if __name__ == "__main__":
    sys.exit(main())
