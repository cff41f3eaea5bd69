#!/usr/bin/env python
"""Checkpoint I/O: elasticrun against safetensors, torch.save/load and torch.distributed.checkpoint (DCP).

    python scripts/bench/bench_checkpoint.py --state gpt --size-gib 0.4 --dir /var/tmp --json ckpt.json
    python scripts/bench/bench_checkpoint.py --state gpt --size-gib 4 --device cuda      # state on the GPU
    python scripts/bench/bench_checkpoint.py --state gpt --size-gib 0.4 --save-ab 10 --dir /var/tmp

The interleaved comparison of ckpt_compare.py (durable saves, cold loads into existing tensors, the disk's cold
read, an async save's stall) with its ``summary``; ``--save-ab N`` instead times N interleaved durable saves of
each library back to back, with the CPU time each one used (what checksumming every file costs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Dict, List

import torch
from ckpt_compare import GB, Libraries, compare_section, gpt_state, nbytes, remove, uniform_state
from common import md_table, shown_command, write_json


def save_ab(d: str, libs: Libraries, runs: int) -> None:
    """``runs`` rounds (after a dropped warm-up) of every library's durable save, with no pause between them."""
    names = ["elasticrun", "elasticrun sha256", "safetensors", "DCP", "torch.save"]
    wall: Dict[str, List[float]] = {k: [] for k in names}
    cpu: Dict[str, List[float]] = {k: [] for k in names}
    for i in range(runs + 1):
        for lib in names:
            path = os.path.join(d, "ab")
            c0, t0 = sum(os.times()[:2]), time.perf_counter()
            libs.save(lib, path)
            t1, c1 = time.perf_counter(), sum(os.times()[:2])
            remove(path)
            if i:
                wall[lib].append(t1 - t0)
                cpu[lib].append(c1 - c0)
    size = nbytes(libs.state)
    print(f"durable saves of {size / GB:.2f} GB, interleaved, median of {runs} (min–max); CPU = user+sys of this "
          "process\n")
    meds = {lib: statistics.median(wall[lib]) for lib in names}
    print(md_table(["save", "seconds", "GB/s", "CPU seconds"],
                   ([lib, f"{m:.2f} ({min(wall[lib]):.2f}–{max(wall[lib]):.2f})", f"{size / GB / m:.2f}",
                     f"{statistics.median(cpu[lib]):.2f}"] for lib, m in meds.items()), "lrrr"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--state", choices=("uniform", "gpt"), default="uniform",
                    help="uniform: float32 in 16 equal tensors; gpt: a GPT-2-like bf16 state, many tensors of mixed "
                         "sizes [uniform]")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the state lives and loads go (cuda: saved from and loaded into GPU tensors)")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure [default: a temp dir]")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the tables show medians [3]")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="seconds of quiet (after a sync) before every timed operation [1.0]")
    ap.add_argument("--save-ab", type=int, default=0, metavar="N", help="only N interleaved durable saves each")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.exit(2, "bench_checkpoint.py: --device cuda needs a CUDA GPU, and torch sees none\n")
    if args.dir is not None and not os.path.isdir(args.dir):
        ap.exit(2, f"bench_checkpoint.py: --dir {args.dir!r} is not a directory; give an existing one on the disk "
                   "to measure\n")
    size = int(args.size_gib * (1 << 30))

    def settle() -> None:
        """Let the kernel finish the previous operation's write-back and frees before the next timed one."""
        os.sync()
        time.sleep(args.settle)

    base = tempfile.mkdtemp(prefix="ckbench-", dir=args.dir)
    try:
        if args.save_ab:
            state = gpt_state(size, args.device) if args.state == "gpt" else uniform_state(size, args.device)
            return save_ab(base, Libraries(state, args.device), args.save_ab)
        doc = compare_section(base, args.state, args.device, size, args.repeat, settle,
                              shown_command(__file__))
        if args.json:
            write_json(args.json, doc)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
