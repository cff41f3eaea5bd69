#!/usr/bin/env python
"""Checkpoint I/O: elasticrun against safetensors, torch.save/load and torch.distributed.checkpoint (DCP).

    python scripts/bench/bench_checkpoint.py --state gpt --size-gib 0.4 --dir /var/tmp --json ckpt.json
    python scripts/bench/bench_checkpoint.py --state gpt --size-gib 4 --device cuda      # state on the GPU

Interleaved rounds (A B C D A B C D ..., a dropped warm-up first, medians reported) of each library's durable
save, a cold load into existing tensors (files evicted with ``posix_fadvise(DONTNEED)``; elasticrun also with
``verify=False``), the disk's cold read of a fresh file of the same size, and an async save's training stall.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
from common import fadvise_evict, md_table, shown_command, summary_row, write_json

GB = 1e9
VOCAB, CTX = 50304, 1024
UNVERIFIED = "elasticrun load, verify=False, into existing tensors (cold)"
SAVE, LOAD, DISK = "save (durable)", "load into existing tensors (cold)", "disk: cold sequential read (dd, fresh file)"


def gpt_state(size_bytes: int, device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> Dict[str, torch.Tensor]:
    """A GPT-2-like state dict of about ``size_bytes``: embeddings, then per layer 12 tensors of mixed sizes
    (layer norms and biases of a few KB, attention/MLP weights of MBs)."""
    item = torch.empty((), dtype=dtype).element_size()
    d = 256
    while d < 4096 and (VOCAB + CTX) * (d * 2) * item + 12 * (d * 2) ** 2 * item * 4 <= size_bytes:
        d *= 2  # the width that leaves room for at least ~4 layers
    layers = max(1, round((size_bytes - (VOCAB + CTX) * d * item) / ((12 * d * d + 13 * d) * item)))
    gen = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype).to(device)

    state = {"wte.weight": t(VOCAB, d), "wpe.weight": t(CTX, d)}
    for i in range(layers):
        for name, shape in (("ln_1.weight", (d,)), ("ln_1.bias", (d,)), ("attn.c_attn.weight", (3 * d, d)),
                            ("attn.c_attn.bias", (3 * d,)), ("attn.c_proj.weight", (d, d)), ("attn.c_proj.bias", (d,)),
                            ("ln_2.weight", (d,)), ("ln_2.bias", (d,)), ("mlp.c_fc.weight", (4 * d, d)),
                            ("mlp.c_fc.bias", (4 * d,)), ("mlp.c_proj.weight", (d, 4 * d)), ("mlp.c_proj.bias", (d,))):
            state[f"h.{i}.{name}"] = t(*shape)
    state["ln_f.weight"], state["ln_f.bias"] = t(d), t(d)
    return state


def uniform_state(size_bytes: int, device: str = "cpu", n: int = 16) -> Dict[str, torch.Tensor]:
    """``n`` float32 tensors of 1024 rows."""
    per = size_bytes // 4 // n
    return {f"layer{i:02d}.weight": torch.full((1024, per // 1024), float(i), device=device) for i in range(n)}


def nbytes(state: Dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def remove(path: str) -> None:
    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def disk_cold_read(d: str, size: int) -> float:
    """Seconds to read back a fresh, fsynced, evicted file of ``size`` bytes with 64 MiB reads, like ``dd``."""
    path = os.path.join(d, "dd.bin")
    block = memoryview(torch.ones(64 << 20, dtype=torch.uint8).numpy())
    with open(path, "wb", buffering=0) as f:
        left = size
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
    fadvise_evict(path)
    buf = bytearray(64 << 20)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    took = time.perf_counter() - t0
    os.remove(path)
    return took


class Libraries:
    """Durable save and load-into-existing-tensors of each library, for one state on one device."""

    def __init__(self, state: Dict[str, torch.Tensor], device: str) -> None:
        self.state, self.device = state, device
        self.target = {k: torch.zeros_like(v) for k, v in state.items()}
        self.names = ["elasticrun", "safetensors", "torch.save", "DCP"]

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def save(self, lib: str, path: str) -> None:
        """``lib``'s durable save."""
        if lib == "elasticrun":
            from elasticrun.checkpoint import save

            save(self.state, path, "c")
        elif lib == "safetensors":
            from safetensors.torch import save_file

            save_file(self.state, path)
            fadvise_evict(path, evict=False)  # its fsync (the others fsync themselves)
        elif lib == "torch.save":
            with open(path, "wb") as f:
                torch.save(self.state, f)
                f.flush()
                os.fsync(f.fileno())
        else:
            import torch.distributed.checkpoint as DCP

            DCP.save(self.state, storage_writer=DCP.FileSystemWriter(path, thread_count=2, sync_files=True))

    def load_into(self, lib: str, path: str, verify: bool = True) -> None:
        tgt = self.target
        if lib == "elasticrun":
            from elasticrun.checkpoint import load

            load(path, "c", state_dict=tgt, verify=verify)
        elif lib in ("safetensors", "torch.save"):
            if lib == "safetensors":
                from safetensors.torch import load_file

                loaded = load_file(path)
            else:
                loaded = torch.load(path, weights_only=True, map_location="cpu")
            with torch.no_grad():  # what model.load_state_dict does with it
                for k, v in loaded.items():
                    tgt[k].copy_(v)
        else:
            import torch.distributed.checkpoint as DCP

            DCP.load(tgt, storage_reader=DCP.FileSystemReader(path))
        self.sync()

    def check(self, lib: str) -> None:
        """The last load really filled the targets (first and last element of each); zero them for the next."""
        for k, v in self.state.items():
            t = self.target[k].reshape(-1)
            if t.numel() and not (bool(t[0] == v.reshape(-1)[0]) and bool(t[-1] == v.reshape(-1)[-1])):
                raise AssertionError(f"{lib} load left {k} wrong")
            self.target[k].zero_()


def run_compare(d: str, libs: Libraries, repeat: int, settle: Callable[[], None]) -> Dict[str, List[float]]:
    """Interleaved rounds (one dropped warm-up first); label -> seconds per round."""
    from elasticrun.checkpoint import AsyncCheckpointer

    runs: Dict[str, List[float]] = {}
    ckpt = AsyncCheckpointer()  # kept across rounds, as a training loop keeps it (its staging buffers reused)

    def timed(label: str, keep: bool, fn: Callable[..., Any], *args: Any) -> Tuple[float, Any]:
        settle()
        libs.sync()
        t0 = time.perf_counter()
        out = fn(*args)
        took = time.perf_counter() - t0
        if keep:
            runs.setdefault(label, []).append(took)
        return took, out

    for rnd in range(repeat + 1):
        keep = rnd > 0
        settle()
        took = disk_cold_read(d, nbytes(libs.state))
        if keep:
            runs.setdefault(DISK, []).append(took)
        for lib in libs.names:
            path = os.path.join(d, f"cmp-{lib}")
            timed(f"{lib} {SAVE}", keep, libs.save, lib, path)
            for label, verify in [(f"{lib} {LOAD}", True)] + ([(UNVERIFIED, False)] if lib == "elasticrun" else []):
                fadvise_evict(path)
                timed(label, keep, libs.load_into, lib, path, verify)
                libs.check(lib)
            remove(path)
        path = os.path.join(d, "cmp-async")
        stall, handle = timed("elasticrun async save: training stall", keep, ckpt.save, libs.state, path, "c")
        t0 = time.perf_counter()
        handle.result()
        if keep:
            runs.setdefault("elasticrun async save: stall + background write", []).append(
                stall + time.perf_counter() - t0)
        remove(path)
    ckpt.close()
    return runs


def summarize(runs: Dict[str, List[float]], size: int, device: str, state_label: str,
              command: str) -> List[Dict[str, Any]]:
    """The ``summary`` rows: elasticrun against the best alternative per operation, load bandwidth against the
    disk's, and the async-save stall against a synchronous save."""
    med = {k: statistics.median(v) for k, v in runs.items() if v}
    tag = f"{state_label}, {size / GB:.2f} GB, {device}"
    rows: List[Dict[str, Any]] = []
    for op, suffix in (("durable checkpoint save", SAVE), ("cold load into existing tensors", LOAD)):
        alts = {k.split(" ")[0]: v for k, v in med.items() if k.endswith(suffix) and not k.startswith("elasticrun")}
        if f"elasticrun {suffix}" in med and alts:
            best = min(alts, key=lambda k: alts[k])
            rows.append(summary_row(f"{op} ({tag})", med[f"elasticrun {suffix}"], best, alts[best], device=device,
                                    command=command))
    disk = med.get(DISK)
    for label, what in ((f"elasticrun {LOAD}", "cold load bandwidth vs the disk's cold read"),
                        (UNVERIFIED, "cold load bandwidth with verify=False (no checksums, as the peers) vs the "
                                     "disk's cold read")):
        if med.get(label) and disk:
            rows.append(summary_row(f"{what} ({tag})", size / GB / med[label], "disk cold read (dd)", size / GB / disk,
                                    "GB/s", "higher", device, command))
    stall, sync_save = med.get("elasticrun async save: training stall"), med.get(f"elasticrun {SAVE}")
    if stall and sync_save:
        rows.append(summary_row(f"async save training stall (target ≤ 0.1 × a synchronous save, ratio ≥ 10) ({tag})",
                                stall, "elasticrun synchronous save", sync_save, device=device, command=command))
    return rows


def compare_section(base: str, state_kind: str, device: str, size: int, repeat: int,
                    settle: Callable[[], None], command: str) -> Dict[str, Any]:
    """Build the state, run the rounds, print the tables; the JSON document's part of it."""
    state = gpt_state(size, device) if state_kind == "gpt" else uniform_state(size, device)
    real = nbytes(state)
    d = os.path.join(base, "compare")
    os.makedirs(d)
    runs = run_compare(d, Libraries(state, device), repeat, settle)
    label = "GPT-like bf16" if state_kind == "gpt" else "uniform float32"
    rows = summarize(runs, real, device, label, command)
    print(f"\ninterleaved comparison: {label} state, {real / GB:.3f} GB in {len(state)} tensors on {device}; "
          f"posix_fadvise(DONTNEED) before loads; medians of {repeat} rounds after a dropped warm-up\n")
    meds = {label: statistics.median(ts) for label, ts in runs.items()}
    print(md_table(["operation", "seconds (median, min–max)", "GB/s"],
                   ([label, f"{m:.3f} ({min(runs[label]):.3f}–{max(runs[label]):.3f})", f"{real / GB / m:.2f}"]
                    for label, m in meds.items()), "lrr"))
    print()
    print(md_table(["metric", "elasticrun", "alternative", "ratio (> 1: elasticrun wins)"],
                   ([r["metric"], f"{r['elasticrun']:.3f} {r['unit']}", f"{r['alternative']} {r['alt_value']:.3f}",
                     f"{r['ratio']:.2f}"] for r in rows), "lrlr"))
    return {"compare": {"state": state_kind, "device": device, "size_bytes": real, "tensors": len(state),
                        "eviction": "fadvise", "runs": runs}, "summary": rows}


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
        doc = compare_section(base, args.state, args.device, size, args.repeat, settle, shown_command(__file__))
        if args.json:
            write_json(args.json, doc)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
