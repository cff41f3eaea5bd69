"""Pure judgements of a node's measured figures: each returns :class:`~elasticrun.health.verdict.Check` rows.

No I/O: the figures come from :mod:`~elasticrun.health.probes`, :mod:`~elasticrun.health.nvml` and
:mod:`~elasticrun.health.torchbench` (or, in tests, from made-up readings of a failing GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from elasticrun.health.thresholds import GIB, Thresholds
from elasticrun.health.verdict import Check, Verdict, at_least, at_most, skipped

# Throttle reasons (nvmlClocksEventReasons) that mean a GPU runs slower than it should. Idle, the
# application clock setting and the SW power cap are how a healthy GPU runs; these are not.
THROTTLE_BAD: Dict[int, str] = {
    0x0000000000000008: "hw slowdown",
    0x0000000000000020: "sw thermal slowdown",
    0x0000000000000040: "hw thermal slowdown",
    0x0000000000000080: "hw power brake",
}

# bf16 dense matmul TFLOP/s that an 8192² torch.mm reaches on a healthy GPU of each model (about 60-70 %
# of the data-sheet peak); matched as a substring of the device name, longest first.
EXPECTED_TFLOPS: Dict[str, float] = {
    "H200": 600.0, "H100 PCIe": 450.0, "H100": 600.0, "GH200": 600.0, "B200": 1100.0,
    "A100": 230.0, "A10G": 55.0, "L40S": 250.0, "L4": 80.0, "V100": 90.0,
}


@dataclass(frozen=True)
class GpuReading:
    """What NVML says about one GPU (None: the driver does not report it on this model)."""

    index: int
    name: str
    temperature_c: Optional[float] = None
    throttle_reasons: Optional[int] = None  # bit mask, nvmlDeviceGetCurrentClocksEventReasons
    ecc_uncorrected: Optional[int] = None  # volatile uncorrected ECC errors
    retired_pages: Optional[int] = None  # double-bit retired pages (or rows remapped for uncorrectable errors)
    retirement_pending: Optional[bool] = None  # a page or row waits for a reset to be retired/remapped
    remap_failed: Optional[bool] = None  # row remapping ran out of spare rows
    memory_total: Optional[int] = None  # bytes
    memory_free: Optional[int] = None
    xid_errors: List[int] = field(default_factory=list)  # XIDs seen while checking (where readable)


def cpu(gflops: Optional[float], th: Thresholds, error: str = "") -> List[Check]:
    """CPU matmul speed."""
    return [at_least("cpu matmul (1 thread)", None if gflops is None else round(gflops, 2), th.min_cpu_gflops,
                     "GFLOP/s", error)]


def storage(label: str, path: str, free_bytes: Optional[int], write_mbps: Optional[float],
            min_free_gib: float, min_write_mbps: float, error: str = "") -> List[Check]:
    """Free space and write speed of ``path`` (``label``: "checkpoint dir" or "/dev/shm")."""
    free_gib = None if free_bytes is None else free_bytes / GIB
    return [at_least(f"{label} free ({path})", None if free_gib is None else round(free_gib, 2),
                     min_free_gib, "GiB", error),
            at_least(f"{label} write ({path})", None if write_mbps is None else round(write_mbps, 1),
                     min_write_mbps, "MB/s", error)]


def etcd(rtt_ms: Optional[float], th: Thresholds, endpoint: str, error: str = "") -> List[Check]:
    """The job's etcd round trip (skipped when no endpoint was given)."""
    if not endpoint:
        return [skipped("etcd round trip", "no --rdzv-endpoint given", "ms")]
    return [at_most(f"etcd round trip ({endpoint})", None if rtt_ms is None else round(rtt_ms, 2),
                    th.max_etcd_rtt_ms, "ms", error)]


def throttle_names(mask: int) -> List[str]:
    """The harmful throttle reasons in ``mask``."""
    return [name for bit, name in THROTTLE_BAD.items() if mask & bit]


def gpu(r: GpuReading, th: Thresholds) -> List[Check]:
    """One GPU's NVML readings: ECC, retired pages / remapped rows, temperature, throttling, free memory, XIDs."""
    p = f"gpu{r.index}"
    rows: List[Check] = []
    if r.ecc_uncorrected is not None:
        rows.append(at_most(f"{p} ecc uncorrected", r.ecc_uncorrected, th.max_gpu_ecc_uncorrected, "errors"))
    if r.retired_pages is not None:
        rows.append(at_most(f"{p} retired pages", r.retired_pages, th.max_gpu_retired_pages, "pages"))
    if r.retirement_pending is not None or r.remap_failed is not None:
        bad = [w for w, on in (("retirement pending (reset the GPU)", r.retirement_pending),
                               ("row remapping failed (replace the GPU)", r.remap_failed)) if on]
        rows.append(Check(f"{p} pending retirement", float(len(bad)), "flags", "== 0",
                          Verdict.FAIL if bad else Verdict.PASS, "; ".join(bad)))
    if r.temperature_c is not None:
        rows.append(at_most(f"{p} temperature", r.temperature_c, th.max_gpu_temp_c, "°C"))
    if r.throttle_reasons is not None:
        names = throttle_names(r.throttle_reasons)
        rows.append(Check(f"{p} clock throttling", float(len(names)), "reasons", "none of hw/thermal/brake",
                          Verdict.FAIL if names else Verdict.PASS, ", ".join(names)))
    if r.memory_total and r.memory_free is not None:
        fraction = r.memory_free / r.memory_total
        held = (r.memory_total - r.memory_free) / GIB
        rows.append(at_least(f"{p} memory free", round(fraction, 3), th.min_gpu_free_fraction, "fraction",
                             f"{fraction:.0%} free: another process holds {held:.1f} GiB"
                             if fraction < th.min_gpu_free_fraction else ""))
    if r.xid_errors:
        rows.append(Check(f"{p} xid errors", float(len(r.xid_errors)), "events", "== 0", Verdict.FAIL,
                          "XID " + ", ".join(str(x) for x in r.xid_errors[:8])))
    return rows


def expected_tflops(name: str) -> Optional[float]:
    """The bf16 matmul speed expected of a GPU named ``name`` (None for a model not in the table)."""
    for model in sorted(EXPECTED_TFLOPS, key=len, reverse=True):
        if model.lower() in name.lower():
            return EXPECTED_TFLOPS[model]
    return None


def gpu_matmuls(rows: Sequence[Mapping[str, Any]], th: Thresholds) -> List[Check]:
    """Each GPU's matmul speed against its model's expected figure and against the node's fastest GPU
    (a GPU of a model not in the table is judged against its peers only)."""
    speeds = [float(r["tflops"]) for r in rows if isinstance(r.get("tflops"), (int, float))]
    best = max(speeds, default=0.0)
    out: List[Check] = []
    for r in rows:
        name, tflops = str(r.get("name", "")), r.get("tflops")
        expected = expected_tflops(name)
        reference = min(x for x in (expected, best) if x) if (expected or best) else None
        label = f"gpu{r.get('index')} matmul bf16"
        if not isinstance(tflops, (int, float)) or reference is None:
            out.append(at_least(label, None, th.min_gpu_matmul_ratio, "of expected", str(r.get("error", ""))))
            continue
        ratio = float(tflops) / reference
        whom = f"expected {expected:g}" if expected and reference == expected else f"the node's best {best:.0f}"
        out.append(at_least(label, round(ratio, 3), th.min_gpu_matmul_ratio, "of expected",
                            f"{float(tflops):.0f} TFLOP/s vs {whom}" if ratio < th.min_gpu_matmul_ratio else ""))
    return out


def allreduce(result: Optional[Mapping[str, Any]], th: Thresholds) -> List[Check]:
    """The loopback all-reduce: a wrong sum or no answer fails, then its bus bandwidth."""
    if not result:
        return [skipped("all-reduce loopback", "not run")]
    backend = str(result.get("backend", "gloo"))
    label = f"all-reduce {backend} ×{result.get('world')}"
    if not result.get("correct"):
        return [Check(label, None, "GB/s", "correct sum", Verdict.FAIL, str(result.get("error") or "wrong sum"))]
    minimum = th.min_nccl_gbps if backend == "nccl" else th.min_gloo_gbps
    gbps = result.get("gbps")
    return [at_least(label, None if gbps is None else round(float(gbps), 3), minimum, "GB/s")]


__all__ = ["EXPECTED_TFLOPS", "THROTTLE_BAD", "GpuReading", "allreduce", "cpu", "etcd", "expected_tflops", "gpu",
           "gpu_matmuls", "storage", "throttle_names"]
