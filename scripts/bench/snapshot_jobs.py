"""Steps lost per failure, measured on real elasticrun jobs (``bench_snapshot.py --parts lost``).

Each job runs ``snapshot_worker.py`` (one tier, one interval) under real agents, a real etcd and gloo workers:
``worker`` (one node of 2 workers, a worker SIGKILLed at steps 12, 29 and 46), ``node`` (two one-worker nodes,
the second SIGKILLed with its agent) and then ``scaleup`` (a new node joins). Per failure: ``lost`` (the last step
rank 0 finished before the restart minus the step it resumed at) and ``recovery_s`` (to the first step after it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from common import Agents, AgentsExited

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "snapshot_worker.py")
_RANK0 = re.compile(r"^\[[^\]/]+/0\]:(.*)$")  # a line of global rank 0
_STEP = re.compile(r"step (\d+)$")
KILL_STEPS = (12, 29, 46)
INTERVALS = (1, 10)  # checkpoint every 1 and every 10 steps
JOB_MB, STEP_SLEEP = 4.0, 0.05  # each rank's state (MiB) and the seconds a training step sleeps


def _rank0_text(line: str, _read_at: float) -> Optional[str]:
    """What global rank 0 printed on ``line`` (None for another rank's line or the agent's)."""
    m = _RANK0.match(line)
    return m.group(1) if m else None


class Job:
    """The agents of one job (:class:`common.Agents`) and what rank 0 prints: ``start resumed <tier> <step>``
    once per start and ``step S`` after each step."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.agents = Agents(parse=_rank0_text)

    def start(self, node: str, args: List[str]) -> None:
        self.agents.start(node, [sys.executable, "-m", "elasticrun", "--node-id", node, *args])

    def rank0(self) -> List[Tuple[float, str]]:
        """(time read, text) of rank 0's lines."""
        return [(ln.t, ln.data) for ln in self.agents.lines() if ln.data is not None]

    def starts(self) -> List[Tuple[int, float, str]]:
        return [(i, t, s) for i, (t, s) in enumerate(self.rank0()) if s.startswith("start resumed ")]

    def last_step(self) -> int:
        for _t, s in reversed(self.rank0()):
            m = _STEP.match(s)
            if m:
                return int(m.group(1))
            if s.startswith("start resumed "):
                return int(s.split()[3])
        return -1

    def wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until ``cond()`` holds (TimeoutError, :class:`common.AgentsExited`)."""
        self.agents.wait_for(lambda: cond() or None, timeout, what)

    def pid(self, node: str, local_rank: int) -> int:
        """The pid of ``node``'s worker ``local_rank``, from its pid file."""
        with open(os.path.join(self.workdir, "run", "pids", f"{node}-{local_rank}")) as f:
            return int(f.read())

    def event(self, act: Callable[[], Any], timeout: float) -> Dict[str, Any]:
        """Do ``act`` (a kill, a join); wait for the restart and its first step; what it cost."""
        before = len(self.starts())
        t0 = time.time()
        act()
        self.wait(lambda: len(self.starts()) > before, timeout, "the restart")
        idx, _t, line = self.starts()[before]
        steps_before = [int(m.group(1)) for _t, s in self.rank0()[:idx] if (m := _STEP.match(s))]
        killed_at = max(steps_before[-3:] or [0])
        resumed, tier = int(line.split()[3]), line.split()[2]
        first = self.agents.wait_for(lambda: next((t for t, s in self.rank0()[idx:] if _STEP.match(s)), None),
                                     timeout, "a step after the restart")
        return {"killed_at": killed_at, "resumed": resumed, "tier": tier, "lost": killed_at - resumed,
                "recovery_s": round(first - t0, 3)}

    def step_time(self) -> Optional[float]:
        """Median seconds between consecutive steps of one incarnation."""
        times, prev = [], None
        for t, s in self.rank0():
            if s.startswith("start resumed "):
                prev = None
            elif _STEP.match(s):
                if prev is not None:
                    times.append(t - prev)
                prev = t
        return statistics.median(times) if times else None


def run_job(scenario: str, mode: str, every: int, endpoint: str, timeout: float = 180.0) -> Dict[str, Any]:
    """One job of ``scenario`` ("worker"; "node": a node lost, then a scale-up); its failures and its step time."""
    workdir = tempfile.mkdtemp(prefix="bench-snap-job-")
    job = Job(workdir)
    client = [WORKER, "--mode", mode, "--every", str(every), "--dir", os.path.join(workdir, "run"), "--mb", str(JOB_MB),
              "--step-sleep", str(STEP_SLEEP), "--steps", "1000000"]
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
            events.append(dict(job.event(lambda: job.agents.kill("n1"), timeout), scenario="node"))
            job.wait(lambda: job.last_step() >= KILL_STEPS[1], timeout, f"step {KILL_STEPS[1]}")
            events.append(dict(job.event(lambda: job.start("n2", common), timeout), scenario="scaleup"))
        codes = job.agents.stop(timeout)
        step_s = job.step_time()
        return {"scenario": scenario, "mode": mode, "every": every, "events": events, "step_s": step_s,
                "exit_codes": codes}
    finally:
        job.agents.close()
        shutil.rmtree(workdir, ignore_errors=True)


def bench_jobs() -> Dict[str, Any]:
    """The ``lost`` part: real jobs, one per (scenario group, mode, interval), interleaved by mode."""
    from elasticrun.store.server import EtcdServer

    jobs: List[Dict[str, Any]] = []
    with EtcdServer() as server:
        for group in ("worker", "node"):
            for every in INTERVALS:
                for mode in ("memory", "disk", "dcp"):
                    t0 = time.perf_counter()
                    try:
                        r = run_job(group, mode, every, server.endpoint)
                    except (TimeoutError, AgentsExited) as err:
                        r = {"scenario": group, "mode": mode, "every": every, "events": [], "error": str(err)}
                    r["wall_s"] = round(time.perf_counter() - t0, 1)
                    print(f"  job {group:6s} {mode:6s} every {every:3d}: "
                          + (", ".join(f"{e['scenario']} lost {e['lost']} (resumed {e['resumed']} from "
                                       f"{e['tier']}, {e['recovery_s']:.1f}s)" for e in r["events"])
                             or r.get("error", "?")), flush=True)
                    jobs.append(r)
    lost: Dict[str, Dict[str, List[int]]] = {}  # scenario -> "mode@every" -> steps lost per failure
    for j in jobs:
        for e in j["events"]:
            lost.setdefault(e["scenario"], {}).setdefault(f"{j['mode']}@{j['every']}", []).append(e["lost"])
    return {"jobs": jobs, "steps_lost": {s: {k: statistics.mean(v) for k, v in by.items()} for s, by in lost.items()}}

