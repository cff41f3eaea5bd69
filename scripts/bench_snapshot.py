"""Memory snapshots vs disk checkpoints for one state: the training stall and the restore time.

    python scripts/bench_snapshot.py --mb 512 [--device cuda] [--repeat 5] [--disk-dir DIR]

One process (world size 1). Measures, for a state of ``--mb`` MiB of float32 tensors:

- ``snapshot``: a synchronous snapshot into shared memory (write + sha256 + commit);
- ``snapshot_async_stall``: what an async snapshot costs the training loop (the host copy);
- ``disk_save``: ``elasticrun.checkpoint.save`` to ``--disk-dir`` (fsync included);
- ``restore_memory`` / ``restore_disk``: ``load`` of the newest generation / checkpoint into
  the state dict (sha256 verified). The disk load usually hits the page cache right after the
  save: it is a lower bound of a real restart's disk load.

Prints one line per measure (median of ``--repeat``) and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List


def _median_s(fn: Callable[[], object], repeat: int) -> float:
    times: List[float] = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: List[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=256, help="state size in MiB (float32 tensors of 16 MiB)")
    p.add_argument("--device", default="cpu", help="where the state lives (cpu or cuda)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--shm", default="/dev/shm", help="the shared-memory filesystem")
    p.add_argument("--disk-dir", default=None, help="disk checkpoint root (default: a temporary dir here)")
    args = p.parse_args(argv)
    if args.mb < 1 or args.repeat < 1:
        print("bench_snapshot.py: error: --mb and --repeat must be positive", file=sys.stderr)
        return 2
    if not os.path.isdir(args.shm):
        print(f"bench_snapshot.py: error: {args.shm} does not exist: pass --shm", file=sys.stderr)
        return 2

    import torch

    from elasticrun.checkpoint import Snapshotter, load, save
    from elasticrun.checkpoint.memory import generations_root

    n = 4 << 20  # 16 MiB float32 tensors
    state: Dict[str, torch.Tensor] = {f"t{i}": torch.randn(n, device=args.device) for i in range((args.mb + 15) // 16)}
    total = sum(t.numel() * t.element_size() for t in state.values())
    base = tempfile.mkdtemp(prefix="elasticrun-bench-snap-", dir=args.shm)
    disk = args.disk_dir or tempfile.mkdtemp(prefix="bench-snap-disk-", dir=".")
    step = [0]
    results: Dict[str, float] = {}
    try:
        sync = Snapshotter(base=base)
        asyn = Snapshotter(base=base, async_snapshots=True)

        def snap_sync() -> None:
            step[0] += 1
            sync.snapshot(state, training_state={"step": step[0]})

        def snap_async_stall() -> None:
            step[0] += 1
            asyn.snapshot(state, training_state={"step": step[0]})

        def disk_save() -> None:
            step[0] += 1
            save(state, disk, training_state={"step": step[0]}, keep_last=2)

        snap_sync()  # first touch of the memory tier
        results["snapshot_s"] = _median_s(snap_sync, args.repeat)
        snap_async_stall()  # buffers allocated once
        asyn.wait()
        stalls = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            snap_async_stall()
            stalls.append(time.perf_counter() - t0)
            asyn.wait()  # (training would go on here)
        results["snapshot_async_stall_s"] = statistics.median(stalls)
        asyn.close()
        results["disk_save_s"] = _median_s(disk_save, args.repeat)
        gens = generations_root(base)
        results["restore_memory_s"] = _median_s(lambda: load(gens, state_dict=state), args.repeat)
        results["restore_disk_s"] = _median_s(lambda: load(disk, state_dict=state), args.repeat)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if args.disk_dir is None:
            shutil.rmtree(disk, ignore_errors=True)
    gib = total / (1 << 30)
    for k, v in results.items():
        print(f"{k:26s} {v * 1000:9.1f} ms  ({gib / v:6.2f} GiB/s)")
    print(json.dumps({"bytes": total, "device": args.device, "repeat": args.repeat, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
