"""Checkpoint I/O: elasticrun against safetensors, torch.save/load and torch.distributed.checkpoint (DCP).

    python scripts/bench/bench_checkpoint.py --state gpt --size-gib 0.4 --dir /var/tmp --json ckpt.json
    python scripts/bench/bench_checkpoint.py --state gpt --size-gib 4 --device cuda      # state on the GPU

Interleaved rounds (a dropped warm-up first, medians reported) of each library's durable save and cold load, the
disk's cold read and an async save's training stall (docs/performance.md, "Checkpoint I/O").
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
import torch.distributed.checkpoint as DCP
from common import fadvise_evict, md_table, shown_command, summary_row, write_json
from safetensors.torch import load_file, save_file

from elasticrun.checkpoint import AsyncCheckpointer, load, save

GB = 1e9
VOCAB, CTX = 50304, 1024
LIBS = ("elasticrun", "safetensors", "torch.save", "DCP")
UNVERIFIED = "elasticrun load, verify=False, into existing tensors (cold)"
SAVE, LOAD, DISK = "save (durable)", "load into existing tensors (cold)", "disk: cold sequential read (dd, fresh file)"
STALL = "elasticrun async save: training stall"


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


def disk_cold_read(d: str, size: int) -> float:
    """Seconds to read back a fresh, fsynced, evicted file of ``size`` bytes with 64 MiB reads, like ``dd``."""
    path = os.path.join(d, "dd.bin")
    buf = bytearray(b"\x01") * (64 << 20)
    with open(path, "wb", buffering=0) as f:
        for left in range(size, 0, -len(buf)):
            f.write(memoryview(buf)[: min(left, len(buf))])
    fadvise_evict(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    took = time.perf_counter() - t0
    os.remove(path)
    return took


def durable_save(lib: str, state: Dict[str, torch.Tensor], path: str) -> None:
    """``lib``'s durable save."""
    if lib == "elasticrun":
        save(state, path, "c")
    elif lib == "safetensors":
        save_file(state, path)
        fadvise_evict(path, evict=False)  # its fsync (the others fsync themselves)
    elif lib == "torch.save":
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    else:
        DCP.save(state, storage_writer=DCP.FileSystemWriter(path, thread_count=2, sync_files=True))


def load_into(lib: str, target: Dict[str, torch.Tensor], path: str, verify: bool = True) -> None:
    """``lib``'s load into the existing tensors of ``target`` (as ``model.load_state_dict`` would copy them), to
    the device's end."""
    if lib == "elasticrun":
        load(path, "c", state_dict=target, verify=verify)
    elif lib == "DCP":
        DCP.load(target, storage_reader=DCP.FileSystemReader(path))
    else:
        loaded = load_file(path) if lib == "safetensors" else torch.load(path, weights_only=True, map_location="cpu")
        with torch.no_grad():
            for k, v in loaded.items():
                target[k].copy_(v)
    if next(iter(target.values())).is_cuda:
        torch.cuda.synchronize()


def run_compare(d: str, state: Dict[str, torch.Tensor], size: int, repeat: int, settle: Callable[[], None],
                sync: Callable[[], None]) -> Dict[str, List[float]]:
    """Interleaved rounds (one dropped warm-up first) on ``state`` of ``size`` bytes; label -> seconds per round."""
    runs: Dict[str, List[float]] = {}
    ckpt = AsyncCheckpointer()  # kept across rounds, as a training loop keeps it (its staging buffers reused)
    target = {k: torch.zeros_like(v) for k, v in state.items()}

    def record(label: str, rnd: int, seconds: float) -> None:
        if rnd > 0:  # round 0 is the warm-up
            runs.setdefault(label, []).append(seconds)

    def timed(label: str, rnd: int, fn: Callable[..., Any], *args: Any) -> Tuple[float, Any]:
        settle()
        sync()
        t0 = time.perf_counter()
        out = fn(*args)
        took = time.perf_counter() - t0
        record(label, rnd, took)
        return took, out

    for rnd in range(repeat + 1):
        settle()
        record(DISK, rnd, disk_cold_read(d, size))
        for lib in LIBS:
            path = os.path.join(d, f"cmp-{lib}")
            timed(f"{lib} {SAVE}", rnd, durable_save, lib, state, path)
            for label, verify in [(f"{lib} {LOAD}", True)] + ([(UNVERIFIED, False)] if lib == "elasticrun" else []):
                fadvise_evict(path)
                timed(label, rnd, load_into, lib, target, path, verify)
                for k, v in state.items():  # the load really filled the targets; zeroed for the next one
                    t, v = target[k].reshape(-1), v.reshape(-1)
                    if t.numel() and not (bool(t[0] == v[0]) and bool(t[-1] == v[-1])):
                        raise AssertionError(f"{label}: {k} wrong")
                    target[k].zero_()
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        path = os.path.join(d, "cmp-async")
        stall, handle = timed(STALL, rnd, ckpt.save, state, path, "c")
        t0 = time.perf_counter()
        handle.result()
        record("elasticrun async save: stall + background write", rnd, stall + time.perf_counter() - t0)
        shutil.rmtree(path)
    ckpt.close()
    return runs


def summarize(runs: Dict[str, List[float]], size: int, device: str, tag: str, command: str) -> List[Dict[str, Any]]:
    """The ``summary`` rows: elasticrun against the best alternative per operation, load bandwidth against the
    disk's, and the async-save stall against a synchronous save."""
    med = {k: statistics.median(v) for k, v in runs.items() if v}
    rows: List[Dict[str, Any]] = []
    for op, suffix in (("durable checkpoint save", SAVE), ("cold load into existing tensors", LOAD)):
        alts = {k.split(" ")[0]: v for k, v in med.items() if k.endswith(suffix) and not k.startswith("elasticrun")}
        if f"elasticrun {suffix}" in med and alts:
            best = min(alts, key=lambda k: alts[k])
            rows.append(summary_row(f"{op} ({tag})", med[f"elasticrun {suffix}"], best, alts[best], device=device,
                                    command=command))
    for label, what in ((f"elasticrun {LOAD}", "cold load bandwidth vs the disk's cold read"),
                        (UNVERIFIED, "cold load bandwidth with verify=False (no checksums, as the peers) vs the "
                                     "disk's cold read")):
        if med.get(label) and med.get(DISK):
            rows.append(summary_row(f"{what} ({tag})", size / GB / med[label], "disk cold read (dd)",
                                    size / GB / med[DISK], "GB/s", "higher", device, command))
    if med.get(STALL) and med.get(f"elasticrun {SAVE}"):
        rows.append(summary_row(f"async save training stall (target ≤ 0.1 × a synchronous save, ratio ≥ 10) ({tag})",
                                med[STALL], "elasticrun synchronous save", med[f"elasticrun {SAVE}"], device=device,
                                command=command))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--state", choices=("uniform", "gpt"), default="uniform",
                    help="uniform: float32 in 16 equal tensors; gpt: GPT-2-like bf16, many tensors of mixed sizes")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the state lives and loads go")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure [default: a temp dir]")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the tables show medians [3]")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds of quiet (after a sync) before each timing")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.exit(2, "bench_checkpoint.py: --device cuda needs a CUDA GPU, and torch sees none\n")
    if args.dir is not None and not os.path.isdir(args.dir):
        ap.exit(2, f"bench_checkpoint.py: --dir {args.dir!r} is not a directory; give an existing one on the disk "
                   "to measure\n")
    size = int(args.size_gib * (1 << 30))
    if args.state == "gpt":
        state, label = gpt_state(size, args.device), "GPT-like bf16"
    else:
        state = {f"layer{i:02d}.weight": torch.full((1024, size // 64 // 1024), float(i), device=args.device)
                 for i in range(16)}
        label = "uniform float32"
    real = sum(t.numel() * t.element_size() for t in state.values())

    def settle() -> None:  # the kernel finishes the previous operation's write-back and frees
        os.sync()
        time.sleep(args.settle)

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with tempfile.TemporaryDirectory(prefix="ckbench-", dir=args.dir) as d:
        runs = run_compare(d, state, real, args.repeat, settle, sync)
    rows = summarize(runs, real, args.device, f"{label}, {real / GB:.2f} GB, {args.device}", shown_command(__file__))
    print(f"\ninterleaved comparison: {label} state, {real / GB:.3f} GB in {len(state)} tensors on {args.device}; "
          f"posix_fadvise(DONTNEED) before loads; medians of {args.repeat} rounds after a dropped warm-up\n")
    meds = {k: statistics.median(v) for k, v in runs.items()}
    print(md_table(["operation", "seconds (median, min–max)", "GB/s"],
                   ([k, f"{m:.3f} ({min(runs[k]):.3f}–{max(runs[k]):.3f})", f"{real / GB / m:.2f}"]
                    for k, m in meds.items()), "lrr"))
    print()
    print(md_table(["metric", "elasticrun", "alternative", "ratio (> 1: elasticrun wins)"],
                   ([r["metric"], f"{r['elasticrun']:.3f} {r['unit']}", f"{r['alternative']} {r['alt_value']:.3f}",
                     f"{r['ratio']:.2f}"] for r in rows), "lrlr"))
    compare = {"state": args.state, "device": args.device, "size_bytes": real, "tensors": len(state),
               "eviction": "fadvise", "runs": runs}
    write_json(args.json, {"compare": compare, "summary": rows})


if __name__ == "__main__":
    main()
