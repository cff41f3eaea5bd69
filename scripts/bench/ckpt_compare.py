"""The interleaved checkpoint comparison of ``bench_checkpoint.py``: elasticrun against
safetensors, torch.save/torch.load and torch.distributed.checkpoint (DCP) on one state, on
the CPU or on a GPU (``--device cuda``), run A B C D A B C D ... with medians reported.

Per round and library: a durable save (fsynced before the clock stops) of the state where it
lives (GPU tensors are saved from the GPU), the files evicted from the page cache with
``posix_fadvise(DONTNEED)`` (an approximation of a cold cache: it drops this machine's clean
pages, not a storage controller's cache), then a load into the caller's existing tensors on
the device, as ``model.load_state_dict`` would (safetensors and torch.load: load, then
``copy_``; DCP and elasticrun: in place). Also per round: the disk's cold read bandwidth
(a fresh file of the state's size, written, fsynced, evicted, then read with 64 MiB reads
like ``dd``), and the training stall of an asynchronous save (the call's return) against a
synchronous one.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

GB = 1e9
VOCAB, CTX = 50304, 1024


def gpt_state(size_bytes: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> Dict[str, torch.Tensor]:
    """A GPT-2-like state dict of about ``size_bytes``: embeddings, then per layer 12 tensors of
    mixed sizes (layer norms and biases of a few KB, attention/MLP weights of MBs)."""
    item = torch.empty((), dtype=dtype).element_size()
    d = 256
    while d < 4096 and (VOCAB + CTX) * (d * 2) * item + 12 * (d * 2) ** 2 * item * 4 <= size_bytes:
        d *= 2  # the width that leaves room for at least ~4 layers
    per_layer = (12 * d * d + 13 * d) * item
    layers = max(1, round((size_bytes - (VOCAB + CTX) * d * item) / per_layer))
    gen = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        x = (torch.randn(*shape, generator=gen) * 0.02).to(dtype)
        return x.to(device) if device != "cpu" else x

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
    """``n`` float32 tensors of 1024 rows (the benchmark's original state)."""
    per = size_bytes // 4 // n
    return {f"layer{i:02d}.weight": torch.full((1024, per // 1024), float(i), device=device) for i in range(n)}


def files_of(path: str) -> List[str]:
    return [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def fadvise_evict(path: str) -> None:
    """Drop ``path``'s clean pages from the page cache (fsync first so every page is clean)."""
    for p in files_of(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_tree(path: str) -> None:
    for p in files_of(path):
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def remove(path: str) -> None:
    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def disk_write_read(d: str, size: int, evict: Callable[[str], Any] = fadvise_evict) -> Tuple[float, float]:
    """Seconds to write and fsync a fresh file of ``size`` bytes, then to read it back cold
    (``evict`` drops it from the page cache first), both with 64 MiB blocks, like ``dd``."""
    path = os.path.join(d, "dd.bin")
    block = memoryview(torch.ones(64 << 20, dtype=torch.uint8).numpy())
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = size
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        os.fsync(f.fileno())
    wrote = time.perf_counter() - t0
    evict(path)
    buf = bytearray(64 << 20)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    took = time.perf_counter() - t0
    os.remove(path)
    return wrote, took


def disk_cold_read(d: str, size: int) -> float:
    """Seconds to read a fresh, fsynced, evicted file of ``size`` bytes with 64 MiB reads."""
    return disk_write_read(d, size)[1]


class Libraries:
    """Save and load-into-existing-tensors of each library, for one state on one device."""

    def __init__(self, state: Dict[str, torch.Tensor], device: str, dcp: bool) -> None:
        self.state, self.device = state, device
        self.target = {k: torch.zeros_like(v) for k, v in state.items()}
        self.names = ["elasticrun", "safetensors", "torch.save", *(["DCP"] if dcp else [])]

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def save(self, lib: str, path: str) -> None:
        if lib == "elasticrun":
            from elasticrun.checkpoint import save

            save(self.state, path, "c")
        elif lib == "safetensors":
            from safetensors.torch import save_file

            save_file(self.state, path)
            fsync_tree(path)
        elif lib == "torch.save":
            with open(path, "wb") as f:
                torch.save(self.state, f)
                f.flush()
                os.fsync(f.fileno())
        else:
            import torch.distributed.checkpoint as DCP
            from torch.distributed.checkpoint import FileSystemWriter

            DCP.save(self.state, storage_writer=FileSystemWriter(path, thread_count=2, sync_files=True))

    def load_into(self, lib: str, path: str) -> None:
        tgt = self.target
        if lib == "elasticrun":
            from elasticrun.checkpoint import load

            load(path, "c", state_dict=tgt)
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
            from torch.distributed.checkpoint import FileSystemReader

            DCP.load(tgt, storage_reader=FileSystemReader(path))
        self.sync()

    def load_unverified(self, path: str) -> None:
        """elasticrun's in-place load with ``verify=False``: what verification costs."""
        from elasticrun.checkpoint import load

        load(path, "c", state_dict=self.target, verify=False)
        self.sync()

    def check(self) -> None:
        """The last load really filled the targets (cheap: first/last element of every tensor)."""
        for k, v in self.state.items():
            t = self.target[k].reshape(-1)
            if t.numel() and not (bool(t[0] == v.reshape(-1)[0]) and bool(t[-1] == v.reshape(-1)[-1])):
                raise AssertionError(f"load left {k} wrong")
            self.target[k].zero_()


UNVERIFIED = "elasticrun load, verify=False, into existing tensors (cold)"


def run_compare(d: str, state: Dict[str, torch.Tensor], device: str, repeat: int, dcp: bool,
                settle: Callable[[], None]) -> Dict[str, List[float]]:
    """Interleaved rounds (one dropped warm-up first); label -> seconds per round."""
    libs = Libraries(state, device, dcp)
    size = sum(t.numel() * t.element_size() for t in state.values())
    runs: Dict[str, List[float]] = {}

    def rec(label: str, t: float, keep: bool) -> None:
        if keep:
            runs.setdefault(label, []).append(t)

    for rnd in range(repeat + 1):
        keep = rnd > 0
        settle()
        rec("disk: cold sequential read (dd, fresh file)", disk_cold_read(d, size), keep)
        for lib in libs.names:
            path = os.path.join(d, f"cmp-{lib}")
            settle()
            libs.sync()
            t0 = time.perf_counter()
            libs.save(lib, path)
            rec(f"{lib} save (durable)", time.perf_counter() - t0, keep)
            fadvise_evict(path)
            settle()
            t0 = time.perf_counter()
            libs.load_into(lib, path)
            rec(f"{lib} load into existing tensors (cold)", time.perf_counter() - t0, keep)
            libs.check()
            if lib == "elasticrun":
                fadvise_evict(path)
                settle()
                t0 = time.perf_counter()
                libs.load_unverified(path)
                rec(UNVERIFIED, time.perf_counter() - t0, keep)
                libs.check()
            remove(path)
        stall, total = async_stall(d, state, libs.sync, settle)
        rec("elasticrun async save: training stall", stall, keep)
        rec("elasticrun async save: stall + background write", total, keep)
    return runs


_ASYNC: List[Any] = []


def async_stall(d: str, state: Dict[str, torch.Tensor], sync: Callable[[], None],
                settle: Callable[[], None]) -> Tuple[float, float]:
    """Stall (the call's return) and total time of an elasticrun async save; the checkpointer is
    kept across rounds, as a training loop keeps it (its staging buffers are reused)."""
    from elasticrun.checkpoint import AsyncCheckpointer

    if not _ASYNC:
        _ASYNC.append(AsyncCheckpointer())
    ckpt = _ASYNC[0]
    path = os.path.join(d, "cmp-async")
    settle()
    sync()
    t0 = time.perf_counter()
    handle = ckpt.save(state, path, "c")
    stall = time.perf_counter() - t0
    handle.result()
    total = time.perf_counter() - t0
    remove(path)
    return stall, total


def summarize(runs: Dict[str, List[float]], size: int, device: str, state_label: str,
              command: str) -> List[Dict[str, Any]]:
    """The preamble's ``summary`` rows: elasticrun against the best alternative per operation,
    load bandwidth against the disk's, and the async-save stall against a synchronous save."""
    med = {k: statistics.median(v) for k, v in runs.items() if v}
    rows: List[Dict[str, Any]] = []

    def row(metric: str, er: float, alt: str, av: float, unit: str, better: str) -> None:
        ratio = (av / er if better == "lower" else er / av) if er and av else float("nan")
        rows.append({"metric": metric, "elasticrun": round(er, 4), "alternative": alt, "alt_value": round(av, 4),
                     "unit": unit, "better": better, "ratio": round(ratio, 3), "device": device, "command": command})

    tag = f"{state_label}, {size / GB:.2f} GB, {device}"
    for op, suffix in (("durable checkpoint save", "save (durable)"),
                       ("cold load into existing tensors", "load into existing tensors (cold)")):
        er = med.get(f"elasticrun {suffix}")
        alts = {k.split(" ")[0]: v for k, v in med.items() if k.endswith(suffix) and not k.startswith("elasticrun")}
        if er is None or not alts:
            continue
        best = min(alts, key=lambda k: alts[k])
        row(f"{op} ({tag})", er, best, alts[best], "s", "lower")
    er_load = med.get("elasticrun load into existing tensors (cold)")
    disk = med.get("disk: cold sequential read (dd, fresh file)")
    if er_load and disk:
        row(f"cold load bandwidth vs the disk's cold read ({tag})", size / GB / er_load, "disk cold read (dd)",
            size / GB / disk, "GB/s", "higher")
    unverified = med.get(UNVERIFIED)
    if unverified and disk:
        row(f"cold load bandwidth with verify=False (no checksums, as the peers) vs the disk's cold read ({tag})",
            size / GB / unverified, "disk cold read (dd)", size / GB / disk, "GB/s", "higher")
    stall, sync_save = med.get("elasticrun async save: training stall"), med.get("elasticrun save (durable)")
    if stall and sync_save:
        row(f"async save training stall (target ≤ 0.1 × a synchronous save, ratio ≥ 10) ({tag})", stall,
            "elasticrun synchronous save", sync_save, "s", "lower")
    return rows


def print_table(runs: Dict[str, List[float]], rows: List[Dict[str, Any]], size: int) -> None:
    print("| operation | seconds (median, min–max) | GB/s |\n|---|---:|---:|")
    for label, ts in runs.items():
        m = statistics.median(ts)
        print(f"| {label} | {m:.3f} ({min(ts):.3f}–{max(ts):.3f}) | {size / GB / m:.2f} |")
    print("\n| metric | elasticrun | alternative | ratio (> 1: elasticrun wins) |\n|---|---:|---|---:|")
    for r in rows:
        print(f"| {r['metric']} | {r['elasticrun']:.3f} {r['unit']} | {r['alternative']} {r['alt_value']:.3f} | "
              f"{r['ratio']:.2f} |")


def compare_section(base: str, state_kind: str, device: str, size: int, repeat: int, dcp: bool,
                    settle: Callable[[], None], warm: Callable[[int], None], command: str) -> Dict[str, Any]:
    """Build the state, run the rounds, print the tables; the JSON document's part of it."""
    state = gpt_state(size, device=device) if state_kind == "gpt" else uniform_state(size, device)
    real = sum(t.numel() * t.element_size() for t in state.values())
    if device == "cpu":
        warm(real)
    d = os.path.join(base, "compare")
    os.makedirs(d)
    runs = run_compare(d, state, device, repeat, dcp, settle)
    label = "GPT-like bf16" if state_kind == "gpt" else "uniform float32"
    rows = summarize(runs, real, device, label, command)
    print(f"\ninterleaved comparison: {label} state, {real / GB:.3f} GB in {len(state)} tensors on {device}; "
          f"cache eviction before loads: posix_fadvise(DONTNEED) per file (approximates a cold cache); medians of "
          f"{repeat} rounds after a dropped warm-up\n")
    print_table(runs, rows, real)
    return {"compare": {"state": state_kind, "device": device, "size_bytes": real, "tensors": len(state),
                        "eviction": "fadvise", "runs": runs}, "summary": rows}
