"""Launch and restart latency: elasticrun against torchrun (c10d) on the same worker and machine.

    python scripts/bench/bench_launch.py --runs 5 --nodes 2 --procs 2 [--json out.json]
    python scripts/bench/bench_launch.py --scenarios launch,launch-multi --launchers elasticrun,torchrun-best

Scenarios: ``launch`` (one node, ``--standalone``: launcher started → rank 0's first step), ``launch-multi``
(``--nodes`` agents on torchrun's c10d line) and ``restart`` (a worker crashes at ``--crash-step`` or
``--crash-after`` s → the first step after the restart). docs/performance.md describes the launchers, the
figures (first line, first fork's wait, agent RSS, elasticrun's ``phases``) and the ``summary`` rows.
"""

from __future__ import annotations

import argparse
import calendar
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
from common import TORCHRUN_TUNED_CONF, Agents, AgentsExited, md_table, shown_command, summary_row, write_json

WORKER = str(Path(__file__).resolve().parent / "launch_worker.py")
STEP = re.compile(r"bench-step (\d+) t=([\d.]+) restart=(\d+) world=(\d+)")
CRASH = re.compile(r"bench-crash t=([\d.]+)")
FIRST_LINE = re.compile(r"bench-start t=([\d.]+)")
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
LAUNCH_MULTI = "launch-multi"
LAUNCH_SCENARIOS = ("launch", LAUNCH_MULTI)
# The launch scenarios' extra figures: Run field → (metric, unit), each lower-is-better against torchrun's.
LAUNCH_FIGURES = {
    "first_line": ("launch -> the script's first line", "s"),
    "fork_wait": ("round formed -> the first worker's first line (first fork's wait)", "s"),
    "agent_rss_mib": ("agent RSS while the workers run", "MiB"),
}


@dataclass
class Run:
    """One measured run."""

    launcher: str
    scenario: str
    outcome: str  # ok | fail | hang
    seconds: Optional[float] = None
    note: str = ""
    crash_after: Optional[float] = None  # restart scenario: the crash's moment (s after the script started)
    phases: Dict[str, float] = field(default_factory=dict)  # elasticrun launch: milestone → s after the start
    device: str = "cpu"  # where the workers trained (cpu: gloo, cuda: NCCL)
    first_line: Optional[float] = None  # launch: s from the start to the first worker script's first line
    fork_wait: Optional[float] = None  # launch: s from the round forming to that first line (the first fork's wait)
    agent_rss_mib: Optional[float] = None  # the largest launcher (agent) process's RSS while the workers ran


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


def restart_summary(runs: List[Run], procs: int, nodes: int, timeout: float, command: str,
                    device: str = "cpu") -> List[Dict]:
    """The JSON ``summary`` rows of the restart scenario, one per crash moment."""
    rows: List[Dict] = []
    for name in dict.fromkeys(label(r) for r in runs if r.scenario == "restart"):
        found = _against_torchrun([r for r in runs if label(r) == name], "seconds", timeout)
        if found:
            moment = "step 3" if name == "restart" else name.split("@")[1]
            rows.append(summary_row(f"worker crash ({moment} into the round) -> first step, {nodes} x {procs}",
                                    found[0], found[1], found[2], device=device, command=command, runs=found[3]))
    return rows


def launch_summary(runs: List[Run], procs: int, nodes: int, timeout: float, command: str,
                   device: str = "cpu") -> List[Dict]:
    """The JSON ``summary`` rows of the launch scenarios: elasticrun's median against the best torchrun's with
    ``delta_s`` (elasticrun minus it), then :data:`LAUNCH_FIGURES`."""
    rows: List[Dict] = []
    for scenario in LAUNCH_SCENARIOS:
        mine = [r for r in runs if r.scenario == scenario]
        shape = f"1 x {procs}, --standalone" if scenario == "launch" else f"{nodes} x {procs}, c10d"
        found = _against_torchrun(mine, "seconds", timeout)
        if found is None:
            continue
        value, alt, alt_value, count = found
        rows.append(summary_row(f"launch -> first step, {shape}", value, alt, alt_value, device=device,
                                command=command, runs=count, delta_s=round(value - alt_value, 3)))
        for name, (metric, unit) in LAUNCH_FIGURES.items():
            fig = _against_torchrun(mine, name, None)
            if fig:
                rows.append(summary_row(f"{metric}, {shape}", fig[0], fig[1], fig[2], unit, device=device,
                                        command=command, runs=fig[3]))
    return rows


def summarize(runs: List[Run]) -> str:
    """A markdown table: per launcher and scenario, median/min/max of good runs, the bad ones, and the medians of
    the script's first line, the first fork's wait and the agent's RSS."""
    rows = []
    for scenario in dict.fromkeys(label(r) for r in runs):
        for launcher in LAUNCHERS:
            mine = [r for r in runs if r.launcher == launcher and label(r) == scenario]
            if not mine:
                continue
            good = _figure(mine, "seconds")
            stats = [f"{f(good):.2f}" for f in (statistics.median, min, max)] if good else ["—"] * 3
            counts = [sum(r.outcome == k for r in mine) for k in ("ok", "fail", "hang")]
            extra = []
            for name, fmt in (("first_line", ".2f"), ("fork_wait", ".3f"), ("agent_rss_mib", ".0f")):
                values = _figure(mine, name)
                extra.append(format(statistics.median(values), fmt) if values else "—")
            rows.append([scenario, launcher, *counts, *stats, *extra])
    return md_table(["scenario", "launcher", "ok", "fail", "hang", "median s", "min s", "max s", "first line s",
                     "fork wait s", "agent RSS MiB"], rows)


def steps(lines: List[str]) -> List[Dict[str, float]]:
    """Rank 0's step lines: step, unix time, restart count, world size."""
    found = (STEP.search(ln) for ln in lines)
    return [{"step": int(m[1]), "t": float(m[2]), "restart": int(m[3]), "world": int(m[4])} for m in found if m]


def _times(pattern: re.Pattern, lines: List[str]) -> List[float]:
    return [float(m[1]) for m in (pattern.search(ln) for ln in lines) if m]


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
        try:
            sizes.append(psutil.Process(p.pid).memory_info().rss)
        except psutil.NoSuchProcess:
            continue
    return round(max(sizes) / 2**20, 1) if sizes else None


def _commands(launcher: str, nodes: int, procs: int, endpoint: str, job: str, c10d: bool = False) -> List[List[str]]:
    """One command per node, each allowing 3 restarts; ``c10d``: elasticrun on torchrun's c10d line too (one agent
    hosts etcd, which grows to 3 members once 3 nodes joined; ``elasticrun-etcd1``: it stays one member)."""
    program = "elasticrun" if launcher.startswith("elasticrun") else "torchrun"
    conf = ["--rdzv-conf", TORCHRUN_TUNED_CONF] if launcher == "torchrun-best" else []
    if nodes == 1 and not endpoint:
        return [[program, "--standalone", "--nproc-per-node", str(procs), "--max-restarts", "3", *conf, WORKER]]
    common = ["--nnodes", str(nodes), "--nproc-per-node", str(procs), "--rdzv-endpoint", endpoint, "--rdzv-id", job,
              "--max-restarts", "3"]
    if program == "torchrun":
        return [["torchrun", *common, "--rdzv-backend", "c10d", *conf, WORKER] for _ in range(nodes)]
    members = 1 if launcher == ONE_MEMBER else 3
    backend = ["--rdzv-backend", "c10d", "--rdzv-conf", f"etcd_members={members}"] if c10d else []
    return [["elasticrun", *common, *backend, "--node-id", f"n{i}", WORKER] for i in range(nodes)]


def _env(launcher: str, scenario: str, crash_step: int, crash_after: Optional[float], device: str) -> Dict[str, str]:
    """The workers' settings (steps, crash) and the launcher's (torchrun logs when its round formed)."""
    env = {"BENCH_STEPS": "5", "BENCH_STEP_S": "0.2", "BENCH_DEVICE": device}
    if launcher.startswith("torchrun"):
        env["LOGLEVEL"] = "INFO"
    if launcher == "torchrun-best":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if scenario == "restart" and crash_after is None:
        env.update(BENCH_CRASH_STEP=str(crash_step), BENCH_STEPS=str(crash_step + 3))
    elif scenario == "restart":
        once = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_launch-crashed-{uuid.uuid4().hex}"
        env.update(BENCH_CRASH_AFTER_S=str(crash_after), BENCH_CRASH_ONCE_FILE=str(once),
                   BENCH_STEPS=str(int(crash_after / 0.2) + 10))
    return env


def run_once(launcher: str, scenario: str, nodes: int, procs: int, timeout: float, endpoint: str,
             crash_step: int = 3, crash_after: Optional[float] = None, device: str = "cpu") -> Run:
    """Start the launcher(s), wait for the step the scenario measures, then stop everything."""
    if nodes == 1:
        endpoint = ""  # --standalone for every launcher
    elif launcher.startswith("torchrun") or scenario == LAUNCH_MULTI:
        from elasticrun.store.server import free_port

        endpoint = f"127.0.0.1:{free_port()}"  # a c10d store (elasticrun: etcd) hosted by one of the agents
    cmds = _commands(launcher, nodes, procs, endpoint, f"bench-{uuid.uuid4().hex[:8]}", c10d=scenario == LAUNCH_MULTI)
    env = _env(launcher, scenario, crash_step, crash_after, device)
    agents = Agents(env)
    started = time.time()
    for i, cmd in enumerate(cmds):
        agents.start(f"n{i}", cmd)

    def measured() -> Optional[float]:
        lines = [ln.text for ln in agents.lines()]
        if scenario in LAUNCH_SCENARIOS:
            found = steps(lines)
            return found[0]["t"] - started if found else None
        crash = min(_times(CRASH, lines), default=None)
        # The new attempt's first step. Not "restart >= 1": torchrun counts restarts per agent, so the
        # workers of a node whose own workers did not fail still see TORCHELASTIC_RESTART_COUNT=0.
        after = [s for s in steps(lines) if crash is not None and s["t"] > crash and s["step"] == 1]
        return after[0]["t"] - crash if after else None

    try:
        result = agents.wait_for(measured, timeout, "the measured step")
        rss = agent_rss_mib(agents)  # the workers still run: the measured step just showed up
    except (TimeoutError, AgentsExited) as err:
        return _failed(launcher, scenario, agents, err, crash_after)
    finally:
        agents.close()
        if "BENCH_CRASH_ONCE_FILE" in env:
            Path(env["BENCH_CRASH_ONCE_FILE"]).unlink(missing_ok=True)
    run = Run(launcher, scenario, "ok", round(result, 3), crash_after=crash_after, agent_rss_mib=rss, device=device)
    if scenario in LAUNCH_SCENARIOS:
        lines = [ln.text for ln in agents.lines()]
        first, formed = first_line(lines), round_formed(lines, launcher)
        run.first_line = None if first is None else round(first - started, 3)
        run.fork_wait = None if first is None or formed is None else round(first - formed, 3)
        if launcher == "elasticrun":
            run.phases = launch_phases(lines, started, result)
    return run


def _failed(launcher: str, scenario: str, agents: Agents, err: Exception, crash_after: Optional[float]) -> Run:
    """A run without the measured step: a hang (time ran out) or a failure; its output kept in a log file."""
    agents.close()
    lines = [ln.text for ln in agents.lines()]
    errors = " | ".join(ln for ln in lines[-200:] if "Error" in ln or "error" in ln)[-300:]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_launch-{launcher}-{scenario}-{uuid.uuid4().hex[:6]}.log"
    log.write_text("\n".join(lines) + "\n")
    outcome = "hang" if isinstance(err, TimeoutError) else "fail"
    return Run(launcher, scenario, outcome, None, f"{err}; log {log}; {errors}", crash_after)


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs per launcher and scenario")
    ap.add_argument("--nodes", type=int, default=2, help="nodes (agents on loopback) in the restart scenario")
    ap.add_argument("--procs", type=int, default=2, help="workers per node")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a run counts as a hang")
    ap.add_argument("--scenarios", default=f"launch,{LAUNCH_MULTI},restart",
                    help=f"comma-separated: launch (one node, --standalone), {LAUNCH_MULTI} (--nodes nodes, c10d), "
                    "restart")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the workers train: cpu (gloo) or cuda (NCCL, one GPU per worker of the machine)")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS),
                    help=f"comma-separated, of {', '.join(LAUNCHERS)} and {ONE_MEMBER} (elasticrun whose c10d-line "
                         "etcd stays one member: what growing to 3 costs at start-up)")
    ap.add_argument("--json", help="also write every run here")
    ap.add_argument("--crash-step", type=int, default=3,
                    help="restart scenario: the step at which the last rank crashes (a later crash lets elasticrun's "
                    "standby workers get ready)")
    ap.add_argument("--crash-after", default="",
                    help="restart scenario: crash the last rank this many seconds after its script started instead, "
                    "one sub-scenario per comma-separated value (e.g. 0.2,1,3)")
    args = ap.parse_args(argv)
    scenarios = args.scenarios.split(",")
    unknown = set(scenarios) - {*LAUNCH_SCENARIOS, "restart"}
    if unknown:
        ap.error(f"--scenarios: unknown {', '.join(sorted(unknown))}; choose from launch,{LAUNCH_MULTI},restart")
    if args.device == "cuda":
        from elasticrun.launch.gpus import visible_gpu_count

        need, have = args.procs * (1 if scenarios == ["launch"] else args.nodes), visible_gpu_count()
        if have < need:  # NCCL takes one GPU per rank
            ap.error(f"--device cuda: {need} workers need {need} GPUs, this machine has {have}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Run every scenario, launcher and crash moment ``--runs`` times, interleaved; print the table."""
    args = parse_args(argv)
    from elasticrun.store.server import EtcdServer

    etcd = EtcdServer().start() if args.nodes > 1 else None
    runs: List[Run] = []
    try:
        moments = [float(m) for m in args.crash_after.split(",") if m.strip()] or [None]
        for scenario in args.scenarios.split(","):
            nodes = 1 if scenario == "launch" else args.nodes
            for moment in moments if scenario == "restart" else [None]:
                for i in range(args.runs):
                    for launcher in args.launchers.split(","):  # interleaved: load changes hit all alike
                        r = run_once(launcher, scenario, nodes, args.procs, args.timeout,
                                     etcd.endpoint if etcd is not None else "", args.crash_step, moment, args.device)
                        runs.append(r)
                        print(f"{label(r):12s} run {i + 1}/{args.runs} {launcher:17s} {r.outcome:5s} "
                              f"{'' if r.seconds is None else f'{r.seconds:.2f}s'} {r.note[:160]}", flush=True)
    finally:
        if etcd is not None:
            etcd.stop()
    print(f"\nprocs per node: {args.procs}; restart scenario: {args.nodes} node(s) on loopback; runs: {args.runs}")
    print(summarize(runs))
    if args.json:
        command = shown_command(__file__, argv)
        summary = launch_summary(runs, args.procs, args.nodes, args.timeout, command, args.device)
        summary += restart_summary(runs, args.procs, args.nodes, args.timeout, command, args.device)
        write_json(args.json, {"runs": [asdict(r) for r in runs], "summary": summary, "device": args.device})
    return 0


if __name__ == "__main__":
    sys.exit(main())
