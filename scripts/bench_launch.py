"""Launch and restart latency: elasticrun vs torchrun (c10d) on the same script and machine.

Scenarios (CPU, gloo, scripts/bench_launch_worker.py: a tiny DDP model, rank 0 logs each step):

  launch   launcher started → first training step (rank 0), one node, ``--procs`` workers.
  restart  a worker crashes at step 3 of the first attempt → first step after the restart,
           ``--nodes`` nodes (agents on loopback) × ``--procs`` workers.

Launchers: elasticrun (defaults), torchrun (defaults) and torchrun "at its best"
(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, --rdzv-conf last_call_timeout=1,keep_alive_interval=1,
keep_alive_max_attempt=3). Each run has a timeout; a run that ends without the expected step
counts as a failure, one that runs out of time as a hang (its processes are killed).

    python scripts/bench_launch.py --runs 5 --nodes 2 --procs 2 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import psutil

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "bench_launch_worker.py")
STEP = re.compile(r"bench-step (\d+) t=([\d.]+) restart=(\d+) world=(\d+)")
CRASH = re.compile(r"bench-crash t=([\d.]+)")
BEST_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
LAUNCHERS = ["elasticrun", "torchrun-default", "torchrun-best"]


@dataclass
class Run:
    """One measured run."""

    launcher: str
    scenario: str
    outcome: str  # ok | fail | hang
    seconds: Optional[float] = None
    note: str = ""


@dataclass
class Output:
    """Lines of the launcher processes, collected by reader threads, with a wake-up for waiters."""

    lines: List[str] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def pump(self, pipe) -> None:  # noqa: ANN001 - a binary pipe
        for raw in iter(pipe.readline, b""):
            with self.cond:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self.cond.notify_all()
        pipe.close()

    def steps(self) -> List[Dict[str, float]]:
        with self.cond:
            found = [STEP.search(ln) for ln in self.lines]
        return [
            {"step": int(m[1]), "t": float(m[2]), "restart": int(m[3]), "world": int(m[4])} for m in found if m
        ]

    def crash_time(self) -> Optional[float]:
        with self.cond:
            for ln in self.lines:
                m = CRASH.search(ln)
                if m:
                    return float(m[1])
        return None


def _env(extra: Dict[str, str]) -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", BENCH_STEPS="5", BENCH_STEP_S="0.2")
    env.update(extra)
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _commands(launcher: str, nodes: int, procs: int, endpoint: str, job: str) -> List[List[str]]:
    """One command per node."""
    if launcher == "elasticrun":
        if nodes == 1 and not endpoint:
            return [["elasticrun", "--standalone", "--nproc-per-node", str(procs), WORKER]]
        return [
            ["elasticrun", "--nnodes", str(nodes), "--nproc-per-node", str(procs), "--rdzv-endpoint", endpoint,
             "--rdzv-id", job, "--node-id", f"n{i}", WORKER]
            for i in range(nodes)
        ]
    conf = ["--rdzv-conf", BEST_CONF] if launcher == "torchrun-best" else []
    if nodes == 1 and not endpoint:
        return [["torchrun", "--standalone", "--nproc-per-node", str(procs), *conf, WORKER]]
    return [
        ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(procs), "--rdzv-backend", "c10d",
         "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--max-restarts", "3", *conf, WORKER]
        for _ in range(nodes)
    ]


def _kill_all(procs: List[subprocess.Popen]) -> None:
    """SIGKILL the launchers and everything below them (workers may sit in their own sessions)."""
    family: List[psutil.Process] = []
    for p in procs:
        try:
            family.append(psutil.Process(p.pid))
            family.extend(psutil.Process(p.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for proc in family:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=10)
    for p in procs:
        p.wait()


def run_once(
    launcher: str, scenario: str, nodes: int, procs: int, timeout: float, endpoint: str, crash_step: int = 3
) -> Run:
    """Start the launcher(s), wait for the step the scenario measures, then stop everything."""
    extra = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if launcher == "torchrun-best" else {}
    if scenario == "restart":
        extra["BENCH_CRASH_STEP"] = str(crash_step)
        extra["BENCH_STEPS"] = str(crash_step + 3)
    if nodes == 1:
        endpoint = ""  # --standalone for every launcher
    elif launcher.startswith("torchrun"):
        endpoint = f"127.0.0.1:{_free_port()}"  # a c10d store hosted by one of the agents
    cmds = _commands(launcher, nodes, procs, endpoint, f"bench-{uuid.uuid4().hex[:8]}")
    out = Output()
    started = time.time()
    running = []
    for cmd in cmds:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=_env(extra), start_new_session=True)
        running.append(p)
        threading.Thread(target=out.pump, args=(p.stdout,), daemon=True).start()

    def measured() -> Optional[float]:
        steps = out.steps()
        if scenario == "launch":
            return steps[0]["t"] - started if steps else None
        crash = out.crash_time()
        # The new attempt's first step. Not "restart >= 1": torchrun counts restarts per agent, so the
        # workers of a node whose own workers did not fail still see TORCHELASTIC_RESTART_COUNT=0.
        after = [s for s in steps if crash is not None and s["t"] > crash and s["step"] == 1]
        return after[0]["t"] - crash if after else None

    deadline = time.monotonic() + timeout
    result: Optional[float] = None
    with out.cond:
        while True:
            out.cond.release()
            try:
                result = measured()
                done = all(p.poll() is not None for p in running)
            finally:
                out.cond.acquire()
            if result is not None or done or time.monotonic() > deadline:
                break
            out.cond.wait(0.2)
    if result is not None:
        _kill_all(running)
        return Run(launcher, scenario, "ok", round(result, 3))
    hung = not all(p.poll() is not None for p in running)
    codes = [p.poll() for p in running]
    _kill_all(running)
    tail = " | ".join(ln for ln in out.lines[-200:] if "Error" in ln or "error" in ln)[-300:]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_launch-{launcher}-{scenario}-{uuid.uuid4().hex[:6]}.log"
    log.write_text("\n".join(out.lines) + "\n")
    tail = f"log {log}; {tail}"
    if hung:
        return Run(launcher, scenario, "hang", None, f"no step after {timeout:.0f}s; {tail}")
    return Run(launcher, scenario, "fail", None, f"exit codes {codes}; {tail}")


def summarize(runs: List[Run]) -> str:
    """A markdown table: per launcher and scenario, median/min/max of good runs and the bad ones."""
    rows = ["| scenario | launcher | ok | fail | hang | median s | min s | max s |", "|---" * 8 + "|"]
    for scenario in ("launch", "restart"):
        for launcher in LAUNCHERS:
            mine = [r for r in runs if r.launcher == launcher and r.scenario == scenario]
            if not mine:
                continue
            good = [r.seconds for r in mine if r.outcome == "ok" and r.seconds is not None]
            stats = (
                [f"{statistics.median(good):.2f}", f"{min(good):.2f}", f"{max(good):.2f}"] if good else ["—"] * 3
            )
            counts = [str(sum(r.outcome == k for r in mine)) for k in ("ok", "fail", "hang")]
            rows.append("| " + " | ".join([scenario, launcher, *counts, *stats]) + " |")
    return "\n".join(rows)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs per launcher and scenario")
    ap.add_argument("--nodes", type=int, default=2, help="nodes (agents on loopback) in the restart scenario")
    ap.add_argument("--procs", type=int, default=2, help="workers per node")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a run counts as a hang")
    ap.add_argument("--scenarios", default="launch,restart")
    ap.add_argument("--launchers", default=",".join(LAUNCHERS))
    ap.add_argument("--json", help="also write every run here")
    ap.add_argument(
        "--crash-step", type=int, default=3,
        help="restart scenario: the step at which the last rank crashes (a later crash lets elasticrun's "
        "standby workers get ready)",
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE.parent))
    from elasticrun.store.server import EtcdServer

    etcd = EtcdServer().start() if args.nodes > 1 else None
    runs: List[Run] = []
    try:
        for scenario in args.scenarios.split(","):
            for i in range(args.runs):
                for launcher in args.launchers.split(","):  # interleaved: load changes hit every launcher alike
                    nodes = 1 if scenario == "launch" else args.nodes
                    endpoint = etcd.endpoint if etcd is not None else ""
                    r = run_once(launcher, scenario, nodes, args.procs, args.timeout, endpoint, args.crash_step)
                    runs.append(r)
                    print(f"{scenario:8s} run {i + 1}/{args.runs} {launcher:17s} {r.outcome:5s} "
                          f"{'' if r.seconds is None else f'{r.seconds:.2f}s'} {r.note[:160]}", flush=True)
    finally:
        if etcd is not None:
            etcd.stop()
    print()
    print(f"procs per node: {args.procs}; restart scenario: {args.nodes} node(s) on loopback; runs: {args.runs}")
    print(summarize(runs))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
