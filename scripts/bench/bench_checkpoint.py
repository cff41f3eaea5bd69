#!/usr/bin/env python
"""Checkpoint I/O benchmark: elasticrun vs torch.save/load, safetensors, torch.distributed.checkpoint.

    python scripts/bench/bench_checkpoint.py --size-gib 1 --dir /var/tmp/ckbench          # 1 process + 2 ranks
    python scripts/bench/bench_checkpoint.py --state gpt --size-gib 0.41 --dir /var/tmp    # GPT-like bf16 state
    python scripts/bench/bench_checkpoint.py --state gpt --size-gib 4 --device cuda        # state on the GPU

Every run ends with an interleaved comparison (scripts/bench/ckpt_compare.py): per round, each
library's durable save and cold load into existing tensors (A B C D A B C D ...), the disk's
cold read, and an async save's training stall; medians, ratios and the JSON ``summary``.
The rows above it (one process, 2 ranks) run for ``--state uniform --device cpu`` only.

Every save is *durable* (fsynced before the clock stops). Before every load the files are
evicted from the page cache (``/proc/sys/vm/drop_caches`` when permitted, otherwise
``posix_fadvise(DONTNEED)`` per file, which works for clean pages without privileges), so
loads are cold reads. Loads allocate fresh tensors (first-touch page faults included),
except the "into state_dict" rows, which fill preallocated tensors in place. The disk's own
bandwidth (dd-style large sequential writes + fsync, and a cold sequential read) is the ceiling.
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
from typing import Any, Callable, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the repository

GB = 1e9


def make_state(size_bytes: int, n: int = 16) -> Dict[str, torch.Tensor]:
    per = size_bytes // 4 // n
    rows = 1024
    state = {}
    for i in range(n):
        t = torch.empty(rows, per // rows)
        t.fill_(float(i))  # touch every page now, outside any timed region
        state[f"layer{i:02d}.weight"] = t
    return state


def touch(state: Any) -> Any:
    """Read one byte of every page of every loaded tensor, so lazily mapped loads (safetensors'
    ``load_file`` returns tensors backed by an mmap) pay for their reads like the others."""
    tensors = state.values() if isinstance(state, dict) else state.state_dict.values()
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return state


def warm_allocator(size: int) -> None:
    """Allocate and touch ``size`` fresh bytes once. The first time a process grows by a GiB
    the kernel is much slower to hand out pages (2.1 s vs 0.7 s for the same load here), and
    that one-time cost would otherwise land on whichever load happens to run first."""
    touch({"x": torch.empty(size, dtype=torch.uint8)})


def nbytes(state: Dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def evict(path: str) -> str:
    """Drop ``path`` from the page cache; returns how."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    from ckpt_compare import fadvise_evict

    fadvise_evict(path)
    return "fadvise"


def fsync_tree(path: str) -> None:
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


SETTLE_S = 1.0


def settle() -> None:
    """Let the kernel finish the previous operation's cleanup (freed pages, deleted files) before
    the next timed one: measured here, a save right after another library's load + delete took
    1.0–1.3 s instead of 0.5 s, and which library ran next decided who paid for it."""
    os.sync()
    time.sleep(SETTLE_S)


def timed(fn: Callable[[], Any], quiet_first: bool = True) -> Tuple[float, Any]:
    if quiet_first:
        settle()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def disk_ceiling(d: str, size: int) -> Tuple[float, float]:
    """The disk's sequential write (fsynced) and cold read of ``size`` bytes, in seconds."""
    from ckpt_compare import disk_write_read

    return disk_write_read(d, size, evict)


def single_process(d: str, state: Dict[str, torch.Tensor], dcp: bool) -> List[Tuple[str, float]]:
    from safetensors.torch import load_file, save_file

    from elasticrun.checkpoint import AsyncCheckpointer, load, save

    rows: List[Tuple[str, float]] = []

    def run_pair(label: str, do_save: Callable[[str], None], do_load: Callable[[str], Any], path: str) -> None:
        t, _ = timed(lambda: do_save(path))
        rows.append((f"{label} save", t))
        evict(path)
        t, _ = timed(lambda: touch(do_load(path)))
        rows.append((f"{label} load", t))
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)

    def torch_save(p: str) -> None:
        with open(p, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    run_pair("torch.save / torch.load", torch_save, lambda p: torch.load(p, weights_only=True), f"{d}/t.pt")

    def st_save(p: str) -> None:
        save_file(state, p)
        fsync_tree(p)

    run_pair("safetensors save_file / load_file", st_save, load_file, f"{d}/s.safetensors")
    run_pair("elasticrun save / load", lambda p: save(state, p, "c"), lambda p: load(p, "c"), f"{d}/e")
    t, _ = timed(lambda: save(state, f"{d}/e1", "c", io_threads=1))
    rows.append(("elasticrun save, io_threads=1 (one file, one hashing thread)", t))
    evict(f"{d}/e1")
    t, _ = timed(lambda: touch(load(f"{d}/e1", "c", verify=False)))
    rows.append(("elasticrun load, verify=False", t))
    shutil.rmtree(f"{d}/e1")
    # load into preallocated tensors (what a resuming trainer does): no first-touch cost
    target = {k: torch.empty_like(v) for k, v in state.items()}
    for t in target.values():
        t.fill_(0)
    save(state, f"{d}/e2", "c")
    evict(f"{d}/e2")
    t, _ = timed(lambda: load(f"{d}/e2", "c", state_dict=target))
    rows.append(("elasticrun load into state_dict", t))
    evict(f"{d}/e2")
    t, _ = timed(lambda: load(f"{d}/e2", "c", state_dict=target, verify=False))
    rows.append(("elasticrun load into state_dict, verify=False", t))
    shutil.rmtree(f"{d}/e2")

    ckpt = AsyncCheckpointer()
    for i in range(2):
        stall, h = timed(lambda i=i: ckpt.save(state, f"{d}/a", f"c{i}"))
        total, _ = timed(h.result, quiet_first=False)
        rows.append((f"elasticrun async_save #{i + 1}: training stall", stall))
        rows.append((f"elasticrun async_save #{i + 1}: stall + background write", stall + total))
        shutil.rmtree(f"{d}/a")  # like the other rows: no earlier checkpoint left on the disk
    ckpt.close()

    if dcp:
        import torch.distributed.checkpoint as DCP
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

        def dcp_save(p: str) -> None:
            DCP.save(state, storage_writer=FileSystemWriter(p, thread_count=2, sync_files=True))

        def dcp_load(p: str) -> Dict[str, torch.Tensor]:
            tgt = {k: torch.empty_like(v) for k, v in state.items()}
            DCP.load(tgt, storage_reader=FileSystemReader(p))
            return tgt

        run_pair("DCP save (2 threads) / load", dcp_save, dcp_load, f"{d}/dcp")
        try:
            stall, fut = timed(lambda: DCP.async_save(state, storage_writer=FileSystemWriter(
                f"{d}/dcpa", thread_count=2, sync_files=True)))
            total, _ = timed(fut.result, quiet_first=False)
            rows.append(("DCP async_save: training stall", stall))
            rows.append(("DCP async_save: stall + background write", stall + total))
        except Exception as err:  # noqa: BLE001 - report and go on
            rows.append((f"DCP async_save failed: {err.__class__.__name__}", float("nan")))
        shutil.rmtree(f"{d}/dcpa", ignore_errors=True)
    return rows


def _rank_main(rank: int, world: int, d: str, size: int, dcp: bool, out: str, repeat: int, pause: float) -> None:
    global SETTLE_S
    SETTLE_S = pause
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["LOCAL_WORLD_SIZE"] = str(world)  # as torchrun/elasticrun set it
    import torch.distributed as dist

    from elasticrun.checkpoint import load, save

    dist.init_process_group("gloo", init_method=f"file://{d}/init", rank=rank, world_size=world)
    state = make_state(size)
    warm_allocator(size)
    rows = []

    def bracket(label: str, fn: Callable[[], Any]) -> None:
        dist.barrier()
        settle()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        rows.append((label, time.perf_counter() - t0))

    for i in range(repeat + 1):  # run 0 warms up (first writes to new disk blocks are slow) and is dropped
        if i == 1:
            rows.clear()
        bracket("elasticrun save, replicated over 2 ranks", lambda: save(state, f"{d}/e", "c"))
        if rank == 0:
            evict(f"{d}/e")
        bracket("elasticrun load, 2 ranks (each gets all)", lambda: touch(load(f"{d}/e", "c")))
        if rank == 0:
            shutil.rmtree(f"{d}/e")
        if dcp:
            import torch.distributed.checkpoint as DCP
            from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

            bracket("DCP save, replicated over 2 ranks", lambda: DCP.save(
                state, storage_writer=FileSystemWriter(f"{d}/dcp", thread_count=1, sync_files=True)))
            if rank == 0:
                evict(f"{d}/dcp")
            tgt = {k: torch.empty_like(v) for k, v in state.items()}
            bracket("DCP load, 2 ranks (each gets all)",
                    lambda tgt=tgt: touch(DCP.load(tgt, storage_reader=FileSystemReader(f"{d}/dcp")) or tgt))
            if rank == 0:
                shutil.rmtree(f"{d}/dcp")
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def save_ab(d: str, state: Dict[str, torch.Tensor], runs: int) -> None:
    """Durable single-process saves only, interleaved run by run with no pause, with the CPU
    time each one used: shows what the checksum of every file (crc32, the default, or sha256)
    costs on this machine."""
    import torch.distributed.checkpoint as DCP
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemWriter

    from elasticrun.checkpoint import save

    def st(p: str) -> None:
        save_file(state, p)
        fsync_tree(p)

    def ts(p: str) -> None:
        with open(p, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    savers = {
        "elasticrun save (crc32 of every file)": lambda p: save(state, p, "c"),
        "elasticrun save (sha256 of every file)": lambda p: save(state, p, "c", checksum="sha256"),
        "safetensors save_file": st,
        "DCP save, 2 threads": lambda p: DCP.save(state, storage_writer=FileSystemWriter(
            p, thread_count=2, sync_files=True)),
        "torch.save": ts,
    }
    wall: Dict[str, List[float]] = {k: [] for k in savers}
    cpu: Dict[str, List[float]] = {k: [] for k in savers}
    for i in range(runs + 1):  # run 0 is a dropped warm-up
        for label, fn in savers.items():
            path = os.path.join(d, "ab")
            c0, t0 = sum(os.times()[:2]), time.perf_counter()
            fn(path)
            t1, c1 = time.perf_counter(), sum(os.times()[:2])
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            if i:
                wall[label].append(t1 - t0)
                cpu[label].append(c1 - c0)
    size = nbytes(state)
    print(f"\ndurable saves of {size / GB:.2f} GB, interleaved, median of {runs} (min–max); CPU = user+sys of this "
          f"process\n\n| save | seconds | GB/s | CPU seconds |\n|---|---:|---:|---:|")
    for label in savers:
        med = statistics.median(wall[label])
        print(f"| {label} | {med:.2f} ({min(wall[label]):.2f}–{max(wall[label]):.2f}) | {size / GB / med:.2f} "
              f"| {statistics.median(cpu[label]):.2f} |")


def compare(base: str, args: argparse.Namespace, size: int) -> Dict[str, Any]:
    """The interleaved comparison (scripts/bench/ckpt_compare.py); its part of the JSON document."""
    from ckpt_compare import compare_section

    command = "python scripts/bench/bench_checkpoint.py " + " ".join(sys.argv[1:])
    return compare_section(base, args.state, args.device, size, args.repeat, not args.no_dcp, settle,
                           warm_allocator, command)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--dir", default=None, help="Directory on the disk to measure [default: a temp dir].")
    ap.add_argument("--no-dcp", action="store_true", help="Skip torch.distributed.checkpoint.")
    ap.add_argument("--no-ranks", action="store_true", help="Skip the 2-rank replicated case.")
    ap.add_argument("--no-single", action="store_true", help="Skip the single-process case.")
    ap.add_argument("--repeat", type=int, default=3, help="Runs of everything; the table shows medians [3].")
    ap.add_argument("--settle", type=float, default=1.0,
                    help="Seconds of quiet (after a sync) before every timed operation [1.0].")
    ap.add_argument("--save-ab", type=int, default=0, metavar="N",
                    help="Only compare durable single-process saves: N interleaved runs each, with CPU time.")
    ap.add_argument("--json", default=None, help="Also write the results to this JSON file.")
    ap.add_argument("--state", choices=("uniform", "gpt"), default="uniform",
                    help="uniform: float32 in 16 equal tensors; gpt: a GPT-2-like bf16 state, many tensors of "
                         "mixed sizes [uniform]. --size-gib sets its size.")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="Where the state lives and where loads go (cuda: saved from and loaded into GPU tensors).")
    ap.add_argument("--no-compare", action="store_true", help="Skip the interleaved comparison.")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.exit(2, "bench_checkpoint.py: --device cuda needs a CUDA GPU, and torch sees none\n")
    legacy = args.state == "uniform" and args.device == "cpu"
    global SETTLE_S
    SETTLE_S = args.settle
    size = int(args.size_gib * (1 << 30))
    base = tempfile.mkdtemp(prefix="ckbench-", dir=args.dir)
    try:
        how = evict(base)
        if args.save_ab:
            save_ab(base, make_state(size), args.save_ab)
            return
        results: List[Tuple[str, float]] = []
        if legacy:
            w, r = disk_ceiling(base, size)
            results += [("disk: sequential write + fsync (ceiling)", w), ("disk: cold sequential read (ceiling)", r)]
        if legacy and not args.no_single:
            state = make_state(size)
            warm_allocator(size)
            single_process(base, state, not args.no_dcp)  # warm-up, dropped: first writes to new blocks are slow
            for _ in range(args.repeat):
                results += single_process(base, state, not args.no_dcp)
            del state
        if legacy and not args.no_ranks:
            import torch.multiprocessing as mp

            out = os.path.join(base, "ranks.json")
            d = os.path.join(base, "ranks")
            os.makedirs(d)
            mp.spawn(_rank_main, args=(2, d, size, not args.no_dcp, out, args.repeat, args.settle), nprocs=2, join=True)
            with open(out) as f:
                results += [tuple(x) for x in json.load(f)]
        runs: Dict[str, List[float]] = {}
        for label, t in results:
            runs.setdefault(label, []).append(t)
        if runs:
            print(f"\nstate: {size / GB:.2f} GB float32 in 16 tensors; cache eviction before loads: {how}; "
                  f"torch {torch.__version__}, {os.cpu_count()} CPUs\n")
            print(f"median of {args.repeat} runs after one warm-up run (min–max in brackets)\n")
            print("| operation | seconds | GB/s |\n|---|---:|---:|")
            for label, ts in runs.items():
                med = statistics.median(ts)
                spread = f" ({min(ts):.2f}–{max(ts):.2f})" if len(ts) > 1 else ""
                print(f"| {label} | {med:.2f}{spread} | {size / GB / med:.2f} |")
        doc: Dict[str, Any] = {"size_bytes": size, "eviction": how, "runs": runs, "summary": []}
        if not args.no_compare:
            doc.update(compare(base, args, size))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
