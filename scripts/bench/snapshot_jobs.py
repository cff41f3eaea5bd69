"""Steps lost per failure, measured on real elasticrun jobs (``bench_snapshot.py --parts lost``).

Each job runs ``scripts/bench/snapshot_worker.py`` (one tier, one interval) under real agents
with a real etcd, gloo workers and real kills:

- ``worker``: one node, 2 workers; a worker is SIGKILLed at steps 12, 29 and 46 (phases 2, 9
  and 6 of a 10-step interval), the agent restarts the workers;
- ``node``: two nodes of one worker each (``--nnodes 1:2``); the second agent and its worker
  are SIGKILLed (the node is lost) and the survivor goes on alone;
- ``scaleup``: in the same job, a new agent then joins and the job re-forms with two nodes.

For every failure: ``lost = killed_at - resumed`` where ``killed_at`` is the last step rank 0
finished before the restart and ``resumed`` the step its new start line names, and
``recovery_s`` from the kill (or the join) to the first step after the restart.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from common import kill_and_reap, stop

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "snapshot_worker.py")
_LINE = re.compile(r"^\[([^\]/]+)/(\d+)\]:(.*)$")
KILL_STEPS = (12, 29, 46)


class Job:
    """Agents of one job and the rank-0 lines they print (timestamped on arrival)."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.agents: Dict[str, subprocess.Popen] = {}
        self.lines: List[Tuple[float, str]] = []  # rank 0's lines, any agent
        self._lock = threading.Lock()

    def start(self, node: str, args: List[str]) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        proc = subprocess.Popen([sys.executable, "-m", "elasticrun", "--node-id", node, *args], cwd=self.workdir,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        self.agents[node] = proc
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = _LINE.match(line.rstrip("\n"))
            if m and m.group(2) == "0":
                with self._lock:
                    self.lines.append((time.monotonic(), m.group(3)))

    def snapshot(self) -> List[Tuple[float, str]]:
        with self._lock:
            return list(self.lines)

    def starts(self) -> List[Tuple[int, float, str]]:
        return [(i, t, s) for i, (t, s) in enumerate(self.snapshot()) if s.startswith("start resumed ")]

    def last_step(self) -> int:
        for _t, s in reversed(self.snapshot()):
            m = re.match(r"step (\d+)$", s)
            if m:
                return int(m.group(1))
            if s.startswith("start resumed "):
                return int(s.split()[3])
        return -1

    def wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
            if all(p.poll() is not None for p in self.agents.values()):
                raise RuntimeError(f"the job ended while waiting for {what}: " + "\n".join(
                    s for _t, s in self.snapshot()[-5:]))
            time.sleep(0.02)

    def pid(self, node: str, local_rank: int) -> int:
        with open(os.path.join(self.workdir, "run", "pids", f"{node}-{local_rank}")) as f:
            return int(f.read())

    def event(self, act: Callable[[], None], timeout: float) -> Dict[str, Any]:
        """Do ``act`` (a kill, a join); wait for the restart and its first step; what it cost."""
        before = len(self.starts())
        t0 = time.monotonic()
        act()
        self.wait(lambda: len(self.starts()) > before, timeout, "the restart")
        idx, _t, line = self.starts()[before]
        lines = self.snapshot()
        steps_before = [int(s.split()[1]) for _t, s in lines[:idx] if re.match(r"step \d+$", s)]
        killed_at = max(steps_before[-3:] or [0])
        resumed, tier = int(line.split()[3]), line.split()[2]
        self.wait(lambda: any(re.match(r"step \d+$", s) for _t, s in self.snapshot()[idx:]), timeout,
                  "a step after the restart")
        first = next(t for t, s in self.snapshot()[idx:] if re.match(r"step \d+$", s))
        return {"killed_at": killed_at, "resumed": resumed, "tier": tier, "lost": killed_at - resumed,
                "recovery_s": round(first - t0, 3)}

    def step_time(self) -> Optional[float]:
        """Median seconds between consecutive steps of one incarnation."""
        times, prev = [], None
        for t, s in self.snapshot():
            if s.startswith("start resumed "):
                prev = None
            elif re.match(r"step \d+$", s):
                if prev is not None:
                    times.append(t - prev)
                prev = t
        times.sort()
        return times[len(times) // 2] if times else None

    def close(self, timeout: float = 60.0) -> List[Optional[int]]:
        """Stop the job (SIGTERM to every live agent, as a user's Ctrl-C would); their exit codes."""
        return stop(list(self.agents.values()), timeout)


def _kill_node(job: Job, node: str) -> None:
    """The node is lost: its agent and its worker die at once (SIGKILL, no cleanup)."""
    pid = job.pid(node, 0)
    os.kill(job.agents[node].pid, signal.SIGKILL)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_job(scenario: str, mode: str, every: int, *, mb: float, step_sleep: float, async_snapshots: bool,
            endpoint: str, timeout: float = 180.0) -> Dict[str, Any]:
    """One job of ``scenario`` ("worker" or "node+scaleup"); its failures and its step time."""
    workdir = tempfile.mkdtemp(prefix="bench-snap-job-")
    job = Job(workdir)
    client = [WORKER, "--mode", mode, "--every", str(every), "--dir", os.path.join(workdir, "run"), "--mb", str(mb),
              "--step-sleep", str(step_sleep), "--steps", "1000000"] + (["--async"] if async_snapshots else [])
    events: List[Dict[str, Any]] = []
    try:
        if scenario == "worker":
            job.start("n0", ["--standalone", "--nproc-per-node", "2", "--max-restarts", "9", "-q", *client])
            for target in KILL_STEPS:
                job.wait(lambda t=target: job.last_step() >= t, timeout, f"step {target}")
                ev = job.event(lambda: os.kill(job.pid("n0", 1), signal.SIGKILL), timeout)
                events.append(dict(ev, scenario="worker"))
        else:
            common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id",
                      f"bench-{os.path.basename(workdir)}", "--max-restarts", "9", "--heartbeat-timeout", "3",
                      "--stability-window", "1", "--shutdown-timeout", "3", "-q", *client]
            job.start("n0", common)
            job.start("n1", common)
            job.wait(lambda: job.starts() and "world 2" in job.starts()[-1][2], timeout, "two nodes")
            job.wait(lambda: job.last_step() >= KILL_STEPS[0], timeout, f"step {KILL_STEPS[0]}")
            events.append(dict(job.event(lambda: _kill_node(job, "n1"), timeout), scenario="node"))
            job.wait(lambda: job.last_step() >= KILL_STEPS[1], timeout, f"step {KILL_STEPS[1]}")
            events.append(dict(job.event(lambda: job.start("n2", common), timeout), scenario="scaleup"))
        codes = job.close(timeout)
        step_s = job.step_time()
        return {"scenario": scenario, "mode": mode, "every": every, "events": events, "step_s": step_s,
                "exit_codes": codes}
    finally:
        kill_and_reap(list(job.agents.values()))
        shutil.rmtree(workdir, ignore_errors=True)


def bench_jobs(args: argparse.Namespace) -> Dict[str, Any]:
    """The ``lost`` part: real jobs, one per (scenario group, mode, interval), interleaved by mode."""
    from elasticrun.store.server import EtcdServer

    groups = (["worker"] if "worker" in args.scenarios else []) + (
        ["node"] if {"node", "scaleup"} & set(args.scenarios) else [])
    jobs: List[Dict[str, Any]] = []
    server = EtcdServer().start() if "node" in groups else None
    try:
        for group in groups:
            for every in args.intervals:
                for mode in ("memory", "disk", "dcp"):
                    t0 = time.perf_counter()
                    try:
                        r = run_job(group, mode, every, mb=args.job_mb, step_sleep=args.step_sleep,
                                    async_snapshots=args.async_snapshots,
                                    endpoint=server.endpoint if server else "")
                    except (TimeoutError, RuntimeError) as err:
                        r = {"scenario": group, "mode": mode, "every": every, "events": [], "error": str(err)}
                    r["wall_s"] = round(time.perf_counter() - t0, 1)
                    print(f"  job {group:6s} {mode:6s} every {every:3d}: "
                          + (", ".join(f"{e['scenario']} lost {e['lost']} (resumed {e['resumed']} from "
                                       f"{e['tier']}, {e['recovery_s']:.1f}s)" for e in r["events"])
                             or r.get("error", "?")), flush=True)
                    jobs.append(r)
    finally:
        if server is not None:
            server.stop()
    lost: Dict[str, Dict[str, float]] = {}
    for scenario in args.scenarios:
        for every in args.intervals:
            for mode in ("memory", "disk", "dcp"):
                vals = [e["lost"] for j in jobs if j["mode"] == mode and j["every"] == every
                        for e in j["events"] if e["scenario"] == scenario]
                if vals:
                    lost.setdefault(scenario, {})[f"{mode}@{every}"] = statistics.mean(vals)
    return {"jobs": jobs, "steps_lost": lost}


__all__ = ["KILL_STEPS", "Job", "bench_jobs", "run_job"]
