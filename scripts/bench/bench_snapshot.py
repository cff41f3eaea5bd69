"""Memory snapshots vs disk checkpoints vs DCP: training stall, restore time, memory, steps lost.

    python scripts/bench/bench_snapshot.py [--mb 256] [--device cuda] [--repeat 3] [--parts stall,restore,lost]

Parts (docs/performance.md, "Memory snapshots"): ``stall`` (one checkpoint's cost to the training loop, and the step
time when checkpointing every step), ``restore`` (``load_latest`` from memory against disk and DCP) and ``lost``
(steps lost per worker crash, node loss and scale-up in real jobs of ``snapshot_worker.py``). Rounds are
interleaved, medians reported; the last line printed is the JSON document.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional
from unittest import mock

import torch
import torch.distributed.checkpoint as dcp
from common import Agents, AgentsExited, fadvise_evict, shown_command, summary_row, write_json

from elasticrun.checkpoint import Snapshotter, save
from elasticrun.checkpoint.memory.space import dir_bytes
from elasticrun.job.env import SNAPSHOT_DIR
from elasticrun.proc import pid_alive
from elasticrun.store.server import EtcdServer
from elasticrun.train import load_latest

PARTS = ("stall", "restore", "lost")
SHM = "/dev/shm"
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "snapshot_worker.py")
KILL_STEPS = (12, 29, 46)
INTERVALS = (1, 10)  # the jobs checkpoint every 1 and every 10 steps
JOB_MB, STEP_SLEEP = 4.0, 0.05  # each rank's state (MiB) and the seconds a training step sleeps
# a line of global rank 0: "step S" or "start resumed <tier> <step> world <n>"
RANK0 = re.compile(r"^\[[^\]/]+/0\]:(?:step (\d+)|start resumed (\S+) (\d+) world (\d+))$")


def _timed(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Seconds ``fn`` took, the device synchronized before and after."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def bench_local(args: argparse.Namespace) -> Dict[str, Any]:
    """The ``stall`` and ``restore`` parts: one process, one state, interleaved rounds."""
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    n = 4 << 20  # 16 MiB float32 tensors
    state = {f"t{i}": torch.randn(n, device=args.device) for i in range((args.mb + 15) // 16)}
    for entry in os.listdir(SHM):  # the shared memory of earlier runs that were killed
        m = re.match(r"^elasticrun-bench-snap-(\d+)-", entry)
        if m is not None and not pid_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(SHM, entry), ignore_errors=True)
    base = tempfile.mkdtemp(prefix=f"elasticrun-bench-snap-{os.getpid()}-", dir=SHM)
    disk = tempfile.mkdtemp(prefix="bench-snap-disk-", dir=".")
    dcp_root = tempfile.mkdtemp(prefix="bench-snap-dcp-", dir=".")
    steps = itertools.count(1)
    samples: Dict[str, List[float]] = {}
    sync_snaps = Snapshotter(base=base)
    async_snaps = Snapshotter(base=base, async_snapshots=True)

    def dcp_save() -> None:
        dcp.save(state, checkpoint_id=os.path.join(dcp_root, f"step-{next(steps):08d}"))
        for old in sorted(os.listdir(dcp_root))[:-2]:
            shutil.rmtree(os.path.join(dcp_root, old), ignore_errors=True)

    savers: Dict[str, Callable[[], Any]] = {  # each checkpoints the next step
        "snapshot_async": lambda: async_snaps.snapshot(state, training_state={"step": next(steps)}),
        "snapshot": lambda: sync_snaps.snapshot(state, training_state={"step": next(steps)}),
        "disk_save": lambda: save(state, disk, training_state={"step": next(steps)}, keep_last=2),
        "dcp_save": dcp_save,
    }

    def record(key: str, fn: Callable[[], Any], evict: Optional[str] = None) -> None:
        """Time ``fn`` into ``key``; with ``evict``, again after that path left the page cache (``key_cold``)."""
        samples.setdefault(f"{key}_s", []).append(_timed(fn, sync))
        if evict:
            fadvise_evict(evict)
            samples.setdefault(f"{key}_cold_s", []).append(_timed(fn, sync))

    res: Dict[str, Any] = {}
    try:
        for fn in savers.values():  # first touch: buffers, files, imports
            fn()
        async_snaps.wait()
        for _ in range(args.repeat if "stall" in args.parts else 0):
            record("snapshot", savers["snapshot"])
            t0 = time.perf_counter()
            record("snapshot_async_stall", savers["snapshot_async"])
            async_snaps.wait()
            samples.setdefault("snapshot_async_total_s", []).append(time.perf_counter() - t0)
            record("disk_save", savers["disk_save"])
            record("dcp_save", dcp_save)
        if "stall" in args.parts:
            res.update(overhead(args, state, sync, savers, async_snaps))
        async_snaps.wait()
        res.update(shm_bytes=dir_bytes(base), generation_bytes=sync_snaps.generation_bytes)
        newest = os.path.join(dcp_root, sorted(os.listdir(dcp_root))[-1])
        empty = os.path.join(base, "no-disk")
        for _ in range(args.repeat if "restore" in args.parts else 0):
            with mock.patch.dict(os.environ, {SNAPSHOT_DIR: base}):  # the memory tier, no disk checkpoint
                record("restore_memory", lambda: load_latest(empty, state_dict=state, restore_rng=False))
            record("restore_disk", lambda: load_latest(disk, state_dict=state, memory=False, restore_rng=False), disk)
            record("dcp_load", lambda: dcp.load(state, checkpoint_id=newest), newest)
    finally:
        async_snaps.close()
        sync_snaps.close()
        for path in (base, dcp_root, disk):
            shutil.rmtree(path, ignore_errors=True)
    res.update({k: statistics.median(v) for k, v in samples.items()})
    return dict(res, samples=samples, bytes=sum(t.numel() * t.element_size() for t in state.values()))


def overhead(args: argparse.Namespace, state: Dict[str, Any], sync: Callable[[], None],
             savers: Dict[str, Callable[[], None]], async_snaps: Any) -> Dict[str, Any]:
    """Step time of a loop of ``--step-ms`` compute steps, checkpointing after every step, per method."""
    a = torch.randn(512, 512, device=args.device)

    def compute(n: int) -> None:
        nonlocal a
        for _ in range(n):
            a = torch.tanh(a @ a * 0.01)

    compute(3)  # warm-up: a device's first matmul sets up its library (cuBLAS: up to a second)
    k = 1
    while (took := _timed(lambda n=k: compute(n), sync)) < 0.2 and k < 1 << 20:  # double until a batch takes 0.2 s
        k *= 2
    iters = max(1, int(args.step_ms / 1000 / (took / k)))

    def step() -> None:
        compute(iters)
        next(iter(state.values())).add_(1.0)  # the state changes every step

    times: Dict[str, List[float]] = {}
    for _ in range(args.repeat):
        for mode in ("none", *savers):
            for _s in range(args.overhead_steps):
                t = _timed(lambda m=mode: (step(), savers[m]() if m != "none" else None), sync)
                times.setdefault(mode, []).append(t)
            async_snaps.wait()
    med = {m: statistics.median(v) for m, v in times.items()}
    out: Dict[str, Any] = {"step_s": med["none"], "step_iters": iters}
    for m in savers:
        out[f"step_{m}_s"] = med[m]
        out[f"overhead_{m}_pct"] = 100.0 * (med[m] / med["none"] - 1.0)
    return out


class Job:
    """The agents of one job and what rank 0 prints, parsed as (time read, step, tier, world): tier is None for a
    step's line and the tier resumed from for a start's."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.agents = Agents(parse=lambda line, t: (m := RANK0.match(line)) and (
            (t, int(m[1]), None, 0) if m[1] else (t, int(m[3]), m[2], int(m[4]))))

    def start(self, node: str, args: List[str]) -> None:
        self.agents.start(node, [sys.executable, "-m", "elasticrun", "--node-id", node, *args])

    def starts(self) -> List[int]:
        """The index in ``agents.found()`` of each start."""
        return [i for i, line in enumerate(self.agents.found()) if line[2] is not None]

    def wait_step(self, target: int) -> None:
        self.agents.wait_for(lambda: (self.agents.found() or [(0, -1)])[-1][1] >= target or None, self.timeout,
                             f"step {target}")

    def event(self, act: Callable[[], Any]) -> Dict[str, Any]:
        """Do ``act`` (a kill, a join); wait for the restart and its first step; what it cost."""
        before, t0 = len(self.starts()), time.time()
        act()
        idx = self.agents.wait_for(lambda: self.starts()[before] if len(self.starts()) > before else None,
                                   self.timeout, "the restart")
        lines = self.agents.found()
        killed_at = max([step for _t, step, tier, _w in lines[:idx] if tier is None][-3:] or [0])
        _t, resumed, tier, _world = lines[idx]
        first = self.agents.wait_for(lambda: next((ln[0] for ln in self.agents.found()[idx:] if ln[2] is None), None),
                                     self.timeout, "a step after the restart")
        return {"killed_at": killed_at, "resumed": resumed, "tier": tier, "lost": killed_at - resumed,
                "recovery_s": round(first - t0, 3)}

    def step_time(self) -> Optional[float]:
        """Median seconds between consecutive steps of one incarnation."""
        lines = self.agents.found()
        times = [b[0] - a[0] for a, b in zip(lines, lines[1:]) if a[2] is None and b[2] is None]
        return statistics.median(times) if times else None


def run_job(scenario: str, mode: str, every: int, endpoint: str, timeout: float = 180.0) -> Dict[str, Any]:
    """One job of ``scenario`` ("worker"; "node": a node lost, then a scale-up); its failures and its step time."""
    workdir = tempfile.mkdtemp(prefix="bench-snap-job-")
    job = Job(timeout)
    client = [WORKER, "--mode", mode, "--every", str(every), "--dir", os.path.join(workdir, "run"), "--mb",
              str(JOB_MB), "--step-sleep", str(STEP_SLEEP), "--steps", "1000000"]
    events: List[Dict[str, Any]] = []
    try:
        if scenario == "worker":
            job.start("n0", ["--standalone", "--nproc-per-node", "2", "--max-restarts", "9", "-q", *client])
            for target in KILL_STEPS:
                job.wait_step(target)
                with open(os.path.join(workdir, "run", "pids", "n0-1")) as f:
                    pid = int(f.read())
                events.append(dict(job.event(lambda p=pid: os.kill(p, signal.SIGKILL)), scenario="worker"))
        else:
            common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id",
                      f"bench-{os.path.basename(workdir)}", "--max-restarts", "9", "--heartbeat-timeout", "3",
                      "--stability-window", "1", "--shutdown-timeout", "3", "-q", *client]
            job.start("n0", common)
            job.start("n1", common)
            job.agents.wait_for(lambda: any(ln[3] == 2 for ln in job.agents.found()) or None, timeout, "two nodes")
            job.wait_step(KILL_STEPS[0])
            events.append(dict(job.event(lambda: job.agents.kill("n1")), scenario="node"))
            job.wait_step(KILL_STEPS[1])
            events.append(dict(job.event(lambda: job.start("n2", common)), scenario="scaleup"))
        codes = job.agents.stop(timeout)
        return {"scenario": scenario, "mode": mode, "every": every, "events": events, "step_s": job.step_time(),
                "exit_codes": codes}
    finally:
        job.agents.close()
        # with the job's files, those of a SIGKILLed agent (elasticrun-<job id>-*: the agent removes its own on exit)
        for path in (workdir, *glob.glob(f"{tempfile.gettempdir()}/elasticrun-bench-{os.path.basename(workdir)}-*")):
            shutil.rmtree(path, ignore_errors=True)


def bench_jobs() -> Dict[str, Any]:
    """The ``lost`` part: real jobs, one per (scenario group, mode, interval), interleaved by mode."""
    jobs: List[Dict[str, Any]] = []
    with EtcdServer() as server:
        for group, every, mode in itertools.product(("worker", "node"), INTERVALS, ("memory", "disk", "dcp")):
            t0 = time.perf_counter()
            try:
                r = run_job(group, mode, every, server.endpoint)
            except (TimeoutError, AgentsExited) as err:
                r = {"scenario": group, "mode": mode, "every": every, "events": [], "error": str(err)}
            r["wall_s"] = round(time.perf_counter() - t0, 1)
            print(f"  job {group:6s} {mode:6s} every {every:3d}: " + (", ".join(
                f"{e['scenario']} lost {e['lost']} (resumed {e['resumed']} from {e['tier']}, {e['recovery_s']:.1f}s)"
                for e in r["events"]) or r.get("error", "?")), flush=True)
            jobs.append(r)
    lost: Dict[str, Dict[str, List[int]]] = {}  # scenario -> "mode@every" -> steps lost per failure
    for j in jobs:
        for e in j["events"]:
            lost.setdefault(e["scenario"], {}).setdefault(f"{j['mode']}@{j['every']}", []).append(e["lost"])
    return {"jobs": jobs, "steps_lost": {s: {k: statistics.mean(v) for k, v in by.items()} for s, by in lost.items()}}


def summarize(res: Dict[str, Any], lost: Dict[str, Any], args: argparse.Namespace,
              command: str) -> List[Dict[str, Any]]:
    """The ``summary`` rows: stalls, step times and restores against disk and DCP, then the jobs' figures."""
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    gb = f"{res.get('bytes', 0) / (1 << 20):.0f} MiB state"
    disk_dcp = (("elasticrun disk save", "disk_save_s"), ("DCP save", "dcp_save_s"))
    every_step = f"step time with a checkpoint every step ({gb}, {args.step_ms:.0f} ms steps): async memory snapshot"
    local = [  # (metric, our key, (alternative, its key) ..., extra fields)
        (f"training stall per checkpoint ({gb}): async memory snapshot", "snapshot_async_stall_s", disk_dcp, {}),
        (f"training stall per checkpoint ({gb}): sync memory snapshot", "snapshot_s", disk_dcp, {}),
        (every_step, "step_snapshot_async_s", (("disk save every step", "step_disk_save_s"),
                                               ("DCP save every step", "step_dcp_save_s")),
         {"overhead_pct": round(res.get("overhead_snapshot_async_pct", 0.0), 1)}),
        (f"restore ({gb}): load_latest from memory", "restore_memory_s", (
            ("elasticrun disk load, cold cache", "restore_disk_cold_s"),
            ("elasticrun disk load, warm cache", "restore_disk_s"), ("DCP load, cold cache", "dcp_load_cold_s"),
            ("DCP load, warm cache", "dcp_load_s")), {})]
    rows = [summary_row(metric, res[ours], alt, res[key], "s", "lower", dev, command, **extra)
            for metric, ours, alts, extra in local if ours in res for alt, key in alts]
    step_of = {(j["mode"], j["every"]): j.get("step_s") for j in lost.get("jobs", []) if j["scenario"] == "worker"}
    tiers = (("disk", "disk checkpoints"), ("dcp", "DCP"))
    for every, (mode, label) in itertools.product(INTERVALS, tiers):
        ours, alt = step_of.get(("memory", every)), step_of.get((mode, every))
        if ours and alt:
            rows.append(summary_row(f"job step time, checkpoint every {every} step(s) ({JOB_MB:g} MiB per rank, "
                                    f"{STEP_SLEEP:g} s steps): memory snapshots", ours, f"{label} every {every}",
                                    alt, command=command))
    # Every tier at one interval loses the same steps: what matters is the sparsest interval's loss against a
    # snapshot every step. The ratio floors both at 1 step.
    lo, hi = min(INTERVALS), max(INTERVALS)
    what = {"worker": "worker crash", "node": "node loss (SIGKILL)", "scaleup": "scale-up"}
    for (scenario, by), (mode, label) in itertools.product(lost.get("steps_lost", {}).items(), tiers):
        ours, alt = by.get(f"memory@{lo}"), by.get(f"{mode}@{hi}")
        if ours is not None and alt is not None:
            rows.append(summary_row(f"steps lost per {what[scenario]}: memory snapshot every {lo}", ours,
                                    f"{label} every {hi}", alt, "steps", command=command,
                                    note="means per failure; the ratio floors both at 1 step"))
            rows[-1]["ratio"] = round(max(alt, 1.0) / max(ours, 1.0), 3)
    return rows


def bad_input(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with the options, in one line (None: nothing)."""
    bad = [x for x in args.parts if x not in PARTS]
    if bad:
        return f"unknown part(s) {', '.join(bad)}: choose from {', '.join(PARTS)}"
    if min(args.mb, args.repeat, args.overhead_steps) < 1:
        return "--mb, --repeat and --overhead-steps must be positive"
    if not os.path.isdir(SHM):
        return f"{SHM} does not exist: no shared memory to snapshot into"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return "--device cuda but no CUDA GPU is visible"
    return None


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=256, help="state size in MiB for stall/restore (1024: ~1 GB)")
    p.add_argument("--device", default="cpu", help="where the state lives (cpu or cuda)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds (medians)")
    p.add_argument("--parts", default="stall,restore", help="comma-separated: stall, restore, lost (real jobs: "
                   "~8 min on 2 cores) [default: stall,restore]")
    p.add_argument("--step-ms", type=float, default=200.0, help="compute per training step in the overhead loop")
    p.add_argument("--overhead-steps", type=int, default=2, help="steps per method per round in the overhead loop")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    error = bad_input(args)
    if error:
        p.exit(2, f"bench_snapshot.py: error: {error}\n")
    # A time limit's SIGTERM ends the run through the finally blocks: no shared memory left behind.
    signal.signal(signal.SIGTERM, lambda *_a: sys.exit(143))
    res = bench_local(args) if {"stall", "restore"} & set(args.parts) else {"bytes": 0}
    for k, v in res.items():
        if k.endswith(("_s", "_pct")) and isinstance(v, float):
            print(f"{k:28s} {v * 1000:9.1f} ms" if k.endswith("_s") else f"{k:28s} {v:9.1f} %")
    lost = bench_jobs() if "lost" in args.parts else {}
    for scenario, by in lost.get("steps_lost", {}).items():
        print(f"steps lost per {scenario:8s} " + "  ".join(f"{k} {v:.1f}" for k, v in sorted(by.items())))
    doc = {"device": args.device, "repeat": args.repeat, **res, **lost, "machine": f"{os.cpu_count()} cpus",
           "summary": summarize(res, lost, args, shown_command(__file__, argv))}
    print(json.dumps(doc))
    write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
