"""Launch and restart latency: elasticrun vs torchrun (c10d) on the same script and machine.

Scenarios (CPU, gloo, scripts/bench/launch_worker.py: a tiny DDP model, rank 0 logs each step):

  launch   launcher started → first training step (rank 0), one node, ``--procs`` workers (``--standalone``).
  launch-multi  the same with ``--nodes`` nodes (agents on loopback, all started at once) on torchrun's c10d
           line (``--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT``): one agent hosts the store (elasticrun:
           its etcd; torchrun: its TCPStore), the others join it.
  restart  a worker crashes at step 3 of the first attempt (or, with ``--crash-after 0.2,1,3``, that many
           seconds after its script started: at any moment of the round) → first step after the
           restart, ``--nodes`` nodes (agents on loopback) × ``--procs`` workers.

Launchers: elasticrun (defaults; on the c10d line its etcd grows to 3 members once 3 nodes joined),
``elasticrun-etcd1`` (``--rdzv-conf etcd_members=1``), torchrun (defaults) and torchrun "at its best"
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, --rdzv-conf last_call_timeout=1,keep_alive_interval=1,
keep_alive_max_attempt=3). Each run has a timeout; a run that ends without the expected step
counts as a failure, one that runs out of time as a hang (its processes are killed).

    python scripts/bench/bench_launch.py --runs 5 --nodes 2 --procs 2 [--json out.json]
    python scripts/bench/bench_launch.py --scenarios launch,launch-multi --launchers elasticrun,torchrun-best

Every launch run also reports the worker script's first line (launch → ``bench-start``), the first fork's wait
(the round formed → that first line: elasticrun's ``round 0 (Start)`` line, torchrun's "Rendezvous complete" line,
which it logs with ``LOGLEVEL=INFO``) and the agent's RSS while the workers run (the largest launcher process,
sampled when the measured step shows up; elasticrun's fork server and store host are separate processes).

``--device cuda``: the workers train on their GPU (``cuda:LOCAL_RANK``) over NCCL; every scenario needs a GPU
per worker of the machine. The JSON's ``summary`` has one row per scenario: elasticrun's median against the
best torchrun's, their ratio, and (``delta_s``) how many seconds elasticrun is behind (negative: ahead).
Elasticrun's launch runs also carry ``phases``: seconds from the start to each of its agents' milestones.
"""

from __future__ import annotations

import argparse
import calendar
import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import psutil
from common import TORCHRUN_TUNED_CONF, Agents, AgentsExited, md_table, shown_command, summary_row, write_json

ONE_MEMBER = "elasticrun-etcd1"  # elasticrun whose hosted etcd stays one member (--rdzv-conf etcd_members=1)

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "launch_worker.py")
STEP = re.compile(r"bench-step (\d+) t=([\d.]+) restart=(\d+) world=(\d+)")
CRASH = re.compile(r"bench-crash t=([\d.]+)")
FIRST_LINE = re.compile(r"bench-start t=([\d.]+)")
# torchrun's INFO lines (glog style, local time): I<MMDD> <HH:MM:SS.micro> <pid> <file:line>] <message>
TORCHRUN_FORMED = re.compile(r"^[IWE](\d\d)(\d\d) (\d\d:\d\d:\d\d)(\.\d+) .*Rendezvous complete for workers")


LAUNCHERS = ["elasticrun", "torchrun-default", "torchrun-best"]
LAUNCH_MULTI = "launch-multi"
LAUNCH_SCENARIOS = ("launch", LAUNCH_MULTI)


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


# The launch scenarios' extra figures: Run field → (metric, unit), each lower-is-better against torchrun's.
LAUNCH_FIGURES = {
    "first_line": ("launch -> the script's first line", "s"),
    "fork_wait": ("round formed -> the first worker's first line (first fork's wait)", "s"),
    "agent_rss_mib": ("agent RSS while the workers run", "MiB"),
}


def label(r: Run) -> str:
    """The scenario as tables show it: ``restart@1s`` for a crash 1 s into the round."""
    return r.scenario if r.crash_after is None else f"{r.scenario}@{r.crash_after:g}s"


def _figure(runs: List[Run], name: str) -> List[float]:
    """The values of field ``name`` in the ok runs that have one (``seconds``: only non-zero ones)."""
    values = (getattr(r, name) for r in runs if r.outcome == "ok")
    return [v for v in values if v is not None and (v or name != "seconds")]


def _against_torchrun(mine: List[Run], name: str, timeout: Optional[float]) -> Optional[Tuple[float, str, float, int]]:
    """elasticrun's median of ``name``, the lowest torchrun median with its note, and elasticrun's run count; None
    without both. With a ``timeout``, a torchrun with no good run counts as that (a lower bound) and says so;
    without, it is left out."""
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
    """The JSON ``summary`` rows of the restart scenario, one per crash moment: elasticrun's median against
    the better torchrun (one with no good run is given ``timeout``, a lower bound on its time, and says so)."""
    rows: List[Dict] = []
    for name in dict.fromkeys(label(r) for r in runs if r.scenario == "restart"):
        found = _against_torchrun([r for r in runs if label(r) == name], "seconds", timeout)
        if found:
            value, alt, alt_value, count = found
            moment = "step 3" if name == "restart" else name.split("@")[1]
            rows.append(summary_row(f"worker crash ({moment} into the round) -> first step, {nodes} x {procs}", value,
                                    alt, alt_value, device=device, command=command, runs=count))
    return rows


def launch_summary(runs: List[Run], procs: int, nodes: int, timeout: float, command: str,
                   devices: Optional[Dict[str, str]] = None) -> List[Dict]:
    """The JSON ``summary`` rows of the launch scenarios: elasticrun's median against the best torchrun's (one
    with no good run counts as ``timeout``) with ``delta_s`` (elasticrun minus it), then :data:`LAUNCH_FIGURES`."""
    rows: List[Dict] = []
    for scenario in LAUNCH_SCENARIOS:
        mine = [r for r in runs if r.scenario == scenario]
        shape = f"1 x {procs}, --standalone" if scenario == "launch" else f"{nodes} x {procs}, c10d"
        device = (devices or {}).get(scenario, "cpu")
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


def _median(values: List[float], fmt: str) -> str:
    return format(statistics.median(values), fmt) if values else "—"


def summarize(runs: List[Run]) -> str:
    """A markdown table: per launcher and scenario, median/min/max of good runs and the bad ones, and the
    medians of the script's first line, the first fork's wait and the agent's RSS where measured."""
    rows = []
    for scenario in dict.fromkeys(label(r) for r in runs):
        for launcher in LAUNCHERS:
            mine = [r for r in runs if r.launcher == launcher and label(r) == scenario]
            if not mine:
                continue
            good = [r.seconds for r in mine if r.outcome == "ok" and r.seconds is not None]
            stats = (
                [f"{statistics.median(good):.2f}", f"{min(good):.2f}", f"{max(good):.2f}"] if good else ["—"] * 3
            )
            counts = [str(sum(r.outcome == k for r in mine)) for k in ("ok", "fail", "hang")]
            extra = [_median(_figure(mine, "first_line"), ".2f"), _median(_figure(mine, "fork_wait"), ".3f"),
                     _median(_figure(mine, "agent_rss_mib"), ".0f")]
            rows.append([scenario, launcher, *counts, *stats, *extra])
    return md_table(["scenario", "launcher", "ok", "fail", "hang", "median s", "min s", "max s", "first line s",
                     "fork wait s", "agent RSS MiB"], rows)


def steps(lines: List[str]) -> List[Dict[str, float]]:
    """Rank 0's step lines: step, unix time, restart count, world size."""
    found = (STEP.search(ln) for ln in lines)
    return [{"step": int(m[1]), "t": float(m[2]), "restart": int(m[3]), "world": int(m[4])} for m in found if m]


def first_line(lines: List[str]) -> Optional[float]:
    """When the first worker script printed its first line (unix time)."""
    found = [float(m[1]) for m in (FIRST_LINE.search(ln) for ln in lines) if m]
    return min(found) if found else None


def crash_time(lines: List[str]) -> Optional[float]:
    """When the crashing worker said it crashes (unix time)."""
    return next((float(m[1]) for m in (CRASH.search(ln) for ln in lines) if m), None)


def _stamped(lines: List[str]) -> List[Tuple[float, str]]:
    """(unix time, line) of elasticrun's agent lines (``<ISO time> elasticrun[node]: <message>``)."""
    found = [(m, ln) for m, ln in ((STAMP.match(ln), ln) for ln in lines) if m]
    return [(calendar.timegm(time.strptime(m[1], "%Y-%m-%dT%H:%M:%S")) + float(m[2] or 0), ln) for m, ln in found]


def round_formed(lines: List[str], launcher: str) -> Optional[float]:
    """When the first round formed (unix time), from the launcher's own log lines."""
    if launcher == "elasticrun":
        return next((t for t, line in _stamped(lines) if "round 0 (Start)" in line), None)
    for line in lines:
        m = TORCHRUN_FORMED.match(line)
        if m:
            year = time.localtime().tm_year
            stamp = time.strptime(f"{year}-{m[1]}-{m[2]} {m[3]}", "%Y-%m-%d %H:%M:%S")
            return time.mktime(stamp) + float(m[4])
    return None


def agent_rss_mib(procs: List[subprocess.Popen]) -> Optional[float]:
    """The largest RSS among the launcher processes (each node's agent), in MiB."""
    sizes = []
    for p in procs:
        try:
            sizes.append(psutil.Process(p.pid).memory_info().rss)
        except psutil.NoSuchProcess:
            continue
    return round(max(sizes) / 2**20, 1) if sizes else None


def _commands(launcher: str, nodes: int, procs: int, endpoint: str, job: str, c10d: bool = False) -> List[List[str]]:
    """One command per node; ``c10d``: elasticrun on torchrun's c10d line too (one agent hosts etcd there, which
    grows to 3 members once 3 nodes joined; ``elasticrun-etcd1``: it stays one member).

    Every launcher may restart the workers (``--max-restarts 3``): the restart scenario crashes one.
    """
    if launcher.startswith("elasticrun"):
        if nodes == 1 and not endpoint:
            return [["elasticrun", "--standalone", "--nproc-per-node", str(procs), "--max-restarts", "3", WORKER]]
        members = 1 if launcher == ONE_MEMBER else 3
        backend = ["--rdzv-backend", "c10d", "--rdzv-conf", f"etcd_members={members}"] if c10d else []
        return [
            ["elasticrun", "--nnodes", str(nodes), "--nproc-per-node", str(procs), *backend,
             "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--node-id", f"n{i}", "--max-restarts", "3", WORKER]
            for i in range(nodes)
        ]
    conf = ["--rdzv-conf", TORCHRUN_TUNED_CONF] if launcher == "torchrun-best" else []
    if nodes == 1 and not endpoint:
        return [["torchrun", "--standalone", "--nproc-per-node", str(procs), "--max-restarts", "3", *conf, WORKER]]
    return [
        ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(procs), "--rdzv-backend", "c10d",
         "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--max-restarts", "3", *conf, WORKER]
        for _ in range(nodes)
    ]


def _restart_env(crash_step: int, crash_after: Optional[float]) -> Dict[str, str]:
    """The worker's crash settings: at step ``crash_step``, or ``crash_after`` s after its script started."""
    if crash_after is None:
        return {"BENCH_CRASH_STEP": str(crash_step), "BENCH_STEPS": str(crash_step + 3)}
    once = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_launch-crashed-{uuid.uuid4().hex}"
    return {"BENCH_CRASH_AFTER_S": str(crash_after), "BENCH_CRASH_ONCE_FILE": str(once),
            "BENCH_STEPS": str(int(crash_after / 0.2) + 10)}


def run_once(
    launcher: str, scenario: str, nodes: int, procs: int, timeout: float, endpoint: str, crash_step: int = 3,
    crash_after: Optional[float] = None, device: str = "cpu",
) -> Run:
    """Start the launcher(s), wait for the step the scenario measures, then stop everything."""
    extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if launcher == "torchrun-best" else {}
    if launcher.startswith("torchrun"):
        extra["LOGLEVEL"] = "INFO"  # its "Rendezvous complete" line, with a time stamp: the round's forming
    extra["BENCH_DEVICE"] = device
    if scenario == "restart":
        extra.update(_restart_env(crash_step, crash_after))
    if nodes == 1:
        endpoint = ""  # --standalone for every launcher
    elif launcher.startswith("torchrun") or scenario == LAUNCH_MULTI:
        from elasticrun.store.server import free_port

        endpoint = f"127.0.0.1:{free_port()}"  # a c10d store (elasticrun: etcd) hosted by one of the agents
    cmds = _commands(launcher, nodes, procs, endpoint, f"bench-{uuid.uuid4().hex[:8]}", c10d=scenario == LAUNCH_MULTI)
    agents = Agents({"BENCH_STEPS": "5", "BENCH_STEP_S": "0.2", **extra})
    started = time.time()
    for i, cmd in enumerate(cmds):
        agents.start(f"n{i}", cmd)

    def measured() -> Optional[float]:
        lines = [ln.text for ln in agents.lines()]
        if scenario in LAUNCH_SCENARIOS:
            found = steps(lines)
            return found[0]["t"] - started if found else None
        crash = crash_time(lines)
        # The new attempt's first step. Not "restart >= 1": torchrun counts restarts per agent, so the
        # workers of a node whose own workers did not fail still see TORCHELASTIC_RESTART_COUNT=0.
        after = [s for s in steps(lines) if crash is not None and s["t"] > crash and s["step"] == 1]
        return after[0]["t"] - crash if after else None

    try:
        result = agents.wait_for(measured, timeout, "the measured step")
    except (TimeoutError, AgentsExited) as err:
        return _failed(launcher, scenario, agents, err, crash_after)
    finally:
        once = extra.get("BENCH_CRASH_ONCE_FILE")
        if once:
            Path(once).unlink(missing_ok=True)
    rss = agent_rss_mib(list(agents.procs.values()))  # the workers still run: the measured step just showed up
    agents.close()
    run = Run(launcher, scenario, "ok", round(result, 3), crash_after=crash_after, agent_rss_mib=rss)
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


# Elasticrun's agent lines (``<ISO time> elasticrun[node]: <message>``) that mark its launch, and whether the
# phase ends at the first such line of all agents or at the last one (every node got there).
MILESTONES = [
    ("etcd up", re.compile(r"started a private etcd|hosting the job's etcd"), "first"),
    ("all nodes joined", re.compile(r"joined job "), "last"),
    ("round formed", re.compile(r"round 0 \(Start\)"), "first"),
    ("workers started", re.compile(r"round 0: workers started"), "last"),
]
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?Z elasticrun\[")


def launch_phases(lines: List[str], started: float, first_step: float) -> Dict[str, float]:
    """Seconds from the launch to each milestone of the agents' log lines, and to the first step."""
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


def main(argv: Optional[List[str]] = None) -> int:
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
    ap.add_argument(
        "--crash-step", type=int, default=3,
        help="restart scenario: the step at which the last rank crashes (a later crash lets elasticrun's "
        "standby workers get ready)",
    )
    ap.add_argument(
        "--crash-after", default="",
        help="restart scenario: crash the last rank this many seconds after its script started instead, one "
        "sub-scenario per comma-separated value (e.g. 0.2,1,3)",
    )
    args = ap.parse_args(argv)
    unknown = set(args.scenarios.split(",")) - {*LAUNCH_SCENARIOS, "restart"}
    if unknown:
        ap.error(f"--scenarios: unknown {', '.join(sorted(unknown))}; choose from launch,{LAUNCH_MULTI},restart")
    devices = {sc: args.device for sc in args.scenarios.split(",")}
    if args.device == "cuda":
        from elasticrun.launch.gpus import visible_gpu_count

        have = visible_gpu_count()
        for sc in devices:
            need = args.procs * (1 if sc == "launch" else args.nodes)
            if have < need:  # NCCL takes one GPU per rank: run this one on the CPU (gloo), as without --device
                devices[sc] = "cpu"
                print(f"{sc}: {need} workers need {need} GPUs, this machine has {have}: measured on the CPU (gloo)",
                      flush=True)
    from elasticrun.store.server import EtcdServer

    etcd = EtcdServer().start() if args.nodes > 1 else None
    runs: List[Run] = []
    try:
        moments = [float(m) for m in args.crash_after.split(",") if m.strip()] or [None]
        for scenario in args.scenarios.split(","):
            for moment in moments if scenario == "restart" else [None]:
                for i in range(args.runs):
                    for launcher in args.launchers.split(","):  # interleaved: load changes hit all alike
                        nodes = 1 if scenario == "launch" else args.nodes
                        endpoint = etcd.endpoint if etcd is not None else ""
                        r = run_once(launcher, scenario, nodes, args.procs, args.timeout, endpoint, args.crash_step,
                                     moment, devices[scenario])
                        r.device = devices[scenario]
                        runs.append(r)
                        print(f"{label(r):12s} run {i + 1}/{args.runs} {launcher:17s} {r.outcome:5s} "
                              f"{'' if r.seconds is None else f'{r.seconds:.2f}s'} {r.note[:160]}", flush=True)
    finally:
        if etcd is not None:
            etcd.stop()
    print()
    print(f"procs per node: {args.procs}; restart scenario: {args.nodes} node(s) on loopback; runs: {args.runs}")
    print(summarize(runs))
    if args.json:
        command = shown_command(__file__, argv)
        summary = launch_summary(runs, args.procs, args.nodes, args.timeout, command, devices)
        summary += restart_summary(runs, args.procs, args.nodes, args.timeout, command,
                                   devices.get("restart", args.device))
        write_json(args.json, {"runs": [asdict(r) for r in runs], "summary": summary, "device": args.device})
    return 0


if __name__ == "__main__":
    sys.exit(main())
