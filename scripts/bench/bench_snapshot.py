"""Memory snapshots vs disk checkpoints vs DCP: training stall, restore time, memory, steps lost.

    python scripts/bench/bench_snapshot.py [--mb 256] [--device cuda] [--repeat 3] [--parts stall,restore,lost]
                                     [--json FILE]

Parts (docs/performance.md, "Memory snapshots"): ``stall`` (what one checkpoint costs the training loop, and the
step time of a loop that checkpoints after every step), ``restore`` (``load_latest`` from memory against disk and
DCP, warm and cold page cache) and ``lost`` (real jobs, ``snapshot_jobs.py``: steps lost per worker crash, node
loss and scale-up). Rounds are interleaved, medians reported; the last line printed is the JSON document.
"""

from __future__ import annotations

import argparse
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

from common import fadvise_evict, shown_command, summary_row, write_json
from snapshot_jobs import INTERVALS, JOB_MB, STEP_SLEEP, bench_jobs

from elasticrun.checkpoint.memory.space import dir_bytes
from elasticrun.proc import pid_alive

PARTS = ("stall", "restore", "lost")


def _sweep(shm: str) -> None:
    """Remove the shared memory of earlier runs that were killed (their pid is gone)."""
    for entry in os.listdir(shm):
        m = re.match(r"^elasticrun-bench-snap-(\d+)-", entry)
        if m is not None and not pid_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(shm, entry), ignore_errors=True)


def _timed(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Seconds ``fn`` took, the device synchronized before and after."""
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def bench_local(args: argparse.Namespace) -> Dict[str, Any]:
    """The ``stall`` and ``restore`` parts: one process, one state, interleaved rounds."""
    import torch
    import torch.distributed.checkpoint as dcp

    from elasticrun.checkpoint import Snapshotter, save
    from elasticrun.job.env import SNAPSHOT_DIR
    from elasticrun.train import load_latest

    dev = args.device
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    n = 4 << 20  # 16 MiB float32 tensors
    state: Dict[str, torch.Tensor] = {f"t{i}": torch.randn(n, device=dev) for i in range((args.mb + 15) // 16)}
    total = sum(t.numel() * t.element_size() for t in state.values())
    _sweep(args.shm)
    base = tempfile.mkdtemp(prefix=f"elasticrun-bench-snap-{os.getpid()}-", dir=args.shm)
    disk = tempfile.mkdtemp(prefix="bench-snap-disk-", dir=".")
    dcp_root = tempfile.mkdtemp(prefix="bench-snap-dcp-", dir=os.path.dirname(os.path.abspath(disk)))
    steps = itertools.count(1)
    res: Dict[str, Any] = {}
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

    def record(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)

    def cold_and_warm(key: str, load: Callable[[], Any], path: str) -> None:
        """``load`` timed with a warm page cache, then again after ``path`` was evicted (``key`` and ``key_cold``)."""
        record(f"{key}_s", _timed(load, sync))
        fadvise_evict(path)
        record(f"{key}_cold_s", _timed(load, sync))

    try:
        for fn in savers.values():  # first touch: buffers, files, imports
            fn()
        async_snaps.wait()
        if "stall" in args.parts:
            for _ in range(args.repeat):
                record("snapshot_s", _timed(savers["snapshot"], sync))
                t0 = time.perf_counter()
                record("snapshot_async_stall_s", _timed(savers["snapshot_async"], sync))
                async_snaps.wait()
                record("snapshot_async_total_s", time.perf_counter() - t0)
                record("disk_save_s", _timed(savers["disk_save"], sync))
                record("dcp_save_s", _timed(dcp_save, sync))
            res.update(overhead(args, state, sync, savers, async_snaps))
        async_snaps.wait()
        res["shm_bytes"] = dir_bytes(base)
        res["generation_bytes"] = sync_snaps.generation_bytes
        if "restore" in args.parts:
            newest = os.path.join(dcp_root, sorted(os.listdir(dcp_root))[-1])
            empty = os.path.join(base, "no-disk")
            for _ in range(args.repeat):
                with mock.patch.dict(os.environ, {SNAPSHOT_DIR: base}):  # the memory tier, no disk checkpoint
                    record("restore_memory_s", _timed(lambda: load_latest(empty, state_dict=state, restore_rng=False),
                                                      sync))
                cold_and_warm("restore_disk", lambda: load_latest(disk, state_dict=state, memory=False,
                                                                  restore_rng=False), disk)
                cold_and_warm("dcp_load", lambda: dcp.load(state, checkpoint_id=newest), newest)
    finally:
        async_snaps.close()
        sync_snaps.close()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(dcp_root, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    res.update({k: statistics.median(v) for k, v in samples.items()})
    res["samples"] = samples
    res["bytes"] = total
    return res


def overhead(args: argparse.Namespace, state: Dict[str, Any], sync: Callable[[], None],
             savers: Dict[str, Callable[[], None]], async_snaps: Any) -> Dict[str, Any]:
    """Step time of a loop of ``--step-ms`` compute steps, checkpointing after every step, per method."""
    import torch

    a = torch.randn(512, 512, device=args.device)
    for _ in range(3):  # warm-up: a device's first matmul sets up its library (cuBLAS: up to a second)
        a = torch.tanh(a @ a * 0.01)
    sync()
    k, per = 1, 0.0
    while True:  # batches of doubling size, each timed to the device's end, until one lasts 0.2 s
        t0 = time.perf_counter()
        for _ in range(k):
            a = torch.tanh(a @ a * 0.01)
        sync()
        per = (time.perf_counter() - t0) / k
        if per * k >= 0.2 or k >= 1 << 20:
            break
        k *= 2
    iters = max(1, int(args.step_ms / 1000 / per))

    def step() -> None:
        nonlocal a
        for _ in range(iters):
            a = torch.tanh(a @ a * 0.01)
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


def summarize(res: Dict[str, Any], lost: Optional[Dict[str, Any]], args: argparse.Namespace,
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
    step_of = {(j["mode"], j["every"]): j.get("step_s") for j in (lost or {}).get("jobs", [])
               if j.get("scenario") == "worker" and j.get("step_s")}
    tiers = (("disk", "disk checkpoints"), ("dcp", "DCP"))
    for every in INTERVALS:
        ours = step_of.get(("memory", every))
        for mode, label in tiers:
            alt = step_of.get((mode, every))
            if ours and alt:
                rows.append(summary_row(f"job step time, checkpoint every {every} step(s) ({JOB_MB:g} MiB per "
                                        f"rank, {STEP_SLEEP:g} s steps): memory snapshots", ours,
                                        f"{label} every {every}", alt, command=command))
    # Steps lost: the interval decides it (every tier at the same interval loses the same), so the
    # row that matters is what a checkpoint every step costs, above, and what it saves against the
    # sparsest interval measured. Floored at 1 step for the ratio; the measured means are kept.
    lo, hi = min(INTERVALS), max(INTERVALS)
    what = {"worker": "worker crash", "node": "node loss (SIGKILL)", "scaleup": "scale-up"}
    for scenario, by in (lost or {}).get("steps_lost", {}).items():
        ours = by.get(f"memory@{lo}")
        for mode, label in tiers:
            alt = by.get(f"{mode}@{hi}")
            if ours is not None and alt is not None and hi != lo:
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
    if args.mb < 1 or args.repeat < 1 or args.overhead_steps < 1:
        return "--mb, --repeat and --overhead-steps must be positive"
    if not os.path.isdir(args.shm):
        return f"{args.shm} does not exist: pass --shm"
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return "--device cuda but no CUDA GPU is visible"
    return None


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=256, help="state size in MiB for stall/restore (1024: ~1 GB)")
    p.add_argument("--device", default="cpu", help="where the state lives (cpu or cuda)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds (medians)")
    p.add_argument("--parts", default="stall,restore", help="comma-separated: stall, restore, lost (real jobs: "
                   "~8 min on 2 cores) [default: stall,restore]")
    p.add_argument("--shm", default="/dev/shm", help="the shared-memory filesystem")
    p.add_argument("--step-ms", type=float, default=200.0, help="compute per training step in the overhead loop")
    p.add_argument("--overhead-steps", type=int, default=2, help="steps per method per round in the overhead loop")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    error = bad_input(args)
    if error is not None:
        print(f"bench_snapshot.py: error: {error}", file=sys.stderr)
        return 2
    # A time limit's SIGTERM ends the run through the finally blocks: no shared memory left behind.
    signal.signal(signal.SIGTERM, lambda *_a: sys.exit(143))
    command = shown_command(__file__, argv)
    res: Dict[str, Any] = {}
    if {"stall", "restore"} & set(args.parts):
        res = bench_local(args)
        gib = res["bytes"] / (1 << 30)
        for k, v in res.items():
            if k.endswith("_s") and isinstance(v, float):
                print(f"{k:28s} {v * 1000:9.1f} ms  ({gib / v:6.2f} GiB/s)" if k != "step_s" and "step_" not in k
                      else f"{k:28s} {v * 1000:9.1f} ms")
            elif k.endswith("_pct"):
                print(f"{k:28s} {v:9.1f} %")
        print(f"{'shm_bytes':28s} {res['shm_bytes'] / (1 << 20):9.1f} MiB ({res['shm_bytes'] / res['bytes']:.2f}x "
              "the state)")
    lost = None
    if "lost" in args.parts:
        lost = bench_jobs()
        for scenario, by in lost["steps_lost"].items():
            print(f"steps lost per {scenario:8s} " + "  ".join(f"{k} {v:.1f}" for k, v in sorted(by.items())))
    doc = {"device": args.device, "repeat": args.repeat, **res, **(lost or {}),
           "machine": f"{os.cpu_count()} cpus", "summary": summarize(res, lost, args, command)}
    doc.setdefault("bytes", 0)
    print(json.dumps(doc))
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
