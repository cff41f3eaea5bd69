"""The node check's torch measurements, run as ``python -m elasticrun.health.torchbench`` in a child
process (the agent never imports torch): CPU matmul speed, per-GPU matmul speed, and a loopback
all-reduce (gloo on CPU, NCCL across the node's GPUs). Prints one JSON object on stdout::

    {"cpu_gflops": 41.2, "gpus": [{"index": 0, "name": "...", "tflops": 612.0}],
     "allreduce": {"backend": "gloo", "world": 2, "correct": true, "gbps": 1.3}}

A measurement that fails is ``null`` with an ``"error"`` next to it; the judging is done by the
caller (:mod:`elasticrun.health.judge`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any, Dict, List, Optional


def _gflops(n: int, seconds: float, repeats: int) -> float:
    return 2.0 * n ** 3 * repeats / seconds / 1e9


def cpu_matmul(n: int = 256, min_s: float = 0.3) -> float:
    """Single-thread float32 GFLOP/s of n×n matmuls over at least ``min_s`` seconds (best of 3)."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm-up
    best = 0.0
    for _ in range(3):
        repeats, t0 = 0, time.perf_counter()
        while True:
            torch.mm(a, b)
            repeats += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_s / 3:
                break
        best = max(best, _gflops(n, elapsed, repeats))
    return best


def gpu_matmuls(n: int = 8192, repeats: int = 20) -> List[Dict[str, Any]]:
    """bf16 TFLOP/s of n×n matmuls on each visible GPU ([] without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    rows = []
    for i in range(torch.cuda.device_count()):
        row: Dict[str, Any] = {"index": i, "name": torch.cuda.get_device_name(i), "tflops": None}
        try:
            with torch.cuda.device(i):
                a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
                torch.mm(a, b)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(repeats):
                    torch.mm(a, b)
                torch.cuda.synchronize()
                row["tflops"] = _gflops(n, time.perf_counter() - t0, repeats) / 1000
        except Exception as err:  # noqa: BLE001 - a broken GPU is what we look for: report it
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _allreduce_worker(rank: int, world: int, port: int, backend: str, numel: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
    x = torch.full((numel,), float(rank + 1), device=device)
    dist.all_reduce(x)
    if backend == "nccl":
        torch.cuda.synchronize()
    repeats = 5
    t0 = time.perf_counter()
    for _ in range(repeats):
        x.fill_(float(rank + 1))
        dist.all_reduce(x)
    if backend == "nccl":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / repeats
    expected = world * (world + 1) / 2
    correct = bool(torch.allclose(x, torch.full_like(x, expected)))
    # bus bandwidth as nccl-tests defines it: size × 2(world-1)/world per second
    gbps = numel * 4 * 2 * (world - 1) / world / seconds / 1e9
    if rank == 0:
        out.put({"backend": backend, "world": world, "correct": correct, "gbps": gbps})
    dist.destroy_process_group()


def allreduce(gpus: int, numel: int = 1 << 18) -> Dict[str, Any]:
    """Loopback all-reduce: NCCL over every GPU when there are 2 or more, else gloo between 2 processes."""
    import torch.multiprocessing as mp

    backend, world = ("nccl", gpus) if gpus >= 2 else ("gloo", 2)
    # gloo on CPU: fork (no CUDA in this process, no second torch import); NCCL needs spawn
    ctx = mp.get_context("spawn" if backend == "nccl" else "fork")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, world, port, backend, numel, out)) for r in range(world)]
    for p in procs:
        p.start()
    result: Optional[Dict[str, Any]] = None
    try:
        result = out.get(timeout=120)
    except Exception as err:  # noqa: BLE001 - a hung or failed collective is a finding
        result = {"backend": backend, "world": world, "correct": False, "gbps": None,
                  "error": f"no result in 120 s ({type(err).__name__})"}
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    return result


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elasticrun.health.torchbench")
    p.add_argument("--no-allreduce", action="store_true")
    p.add_argument("--no-gpu", action="store_true")
    args = p.parse_args(argv)
    doc: Dict[str, Any] = {}
    try:
        doc["cpu_gflops"] = cpu_matmul()
    except Exception as err:  # noqa: BLE001
        doc["cpu_gflops"], doc["cpu_error"] = None, f"{type(err).__name__}: {err}"[:300]
    doc["gpus"] = [] if args.no_gpu else gpu_matmuls()
    if not args.no_allreduce:
        doc["allreduce"] = allreduce(len(doc["gpus"]))
    json.dump(doc, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
