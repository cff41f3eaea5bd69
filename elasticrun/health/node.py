"""The whole node check: measure (probes, NVML, the torch child), then judge; the report of ``elasticrun
check`` and of ``run --node-check``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from elasticrun.health import judge, nvml, probes
from elasticrun.health.thresholds import Thresholds
from elasticrun.health.verdict import Check, failures, skipped, summary
from elasticrun.job.shm import SHM_DIR


@dataclass
class CheckPlan:
    """What to check. ``etcd_read``: one read of the job's etcd (None: skipped)."""

    ckpt_dir: str = "."
    shm_dir: str = SHM_DIR
    endpoint: str = ""
    etcd_read: Optional[Callable[[], Any]] = None
    thresholds: Thresholds = field(default_factory=Thresholds)
    gpu: bool = True  # look for GPUs (NVML) and measure them when there are any
    allreduce: bool = True
    torch: bool = True  # the matmul and all-reduce measurements (a child process importing torch)


@dataclass(frozen=True)
class NodeReport:
    """Every check's row, in order."""

    checks: List[Check]

    @property
    def passed(self) -> bool:
        return not failures(self.checks)

    @property
    def reason(self) -> str:
        """The failed checks in one line ('' when it passed)."""
        return summary(self.checks)

    def to_dict(self) -> Dict[str, Any]:
        return {"passed": self.passed, "reason": self.reason, "checks": [c.to_dict() for c in self.checks]}


def run_check(plan: CheckPlan) -> NodeReport:
    """Measure and judge this node as ``plan`` says."""
    th = plan.thresholds
    rows: List[Check] = []
    readings = nvml.read_gpus() if plan.gpu else None
    figures: Dict[str, Any] = {}
    if plan.torch:
        figures = probes.torch_figures(gpu=bool(readings), allreduce=plan.allreduce)
    error = str(figures.get("error", "")) if plan.torch else ""
    if plan.torch:
        rows += judge.cpu(figures.get("cpu_gflops"), th, error or str(figures.get("cpu_error", "")))
    else:
        rows.append(skipped("cpu matmul (1 thread)", "torch measurements off", "GFLOP/s"))
    ck = probes.storage(plan.ckpt_dir)
    rows += judge.storage("checkpoint dir", ck.path, ck.free_bytes, ck.write_mbps, th.min_disk_free_gib,
                          th.min_disk_write_mbps, ck.error)
    shm = probes.storage(plan.shm_dir)
    rows += judge.storage("shm", shm.path, shm.free_bytes, shm.write_mbps, th.min_shm_free_gib,
                          th.min_shm_write_mbps, shm.error)
    rtt: Optional[float] = None
    etcd_error = ""
    if plan.endpoint and plan.etcd_read is not None:
        try:
            rtt = probes.round_trip_ms(plan.etcd_read)
        except Exception as err:  # noqa: BLE001 - an unreachable etcd is a finding, in words
            etcd_error = f"no answer: {err}"[:300]
    rows += judge.etcd(rtt, th, plan.endpoint, etcd_error)
    if readings is None:
        rows.append(skipped("gpus (NVML)", "no NVIDIA driver: not a GPU node"))
    else:
        for reading in readings:
            rows += judge.gpu(reading, th)
        if plan.torch and readings:
            rows += judge.gpu_matmuls(figures.get("gpus") or [{"index": r.index, "name": r.name, "tflops": None,
                                                               "error": error} for r in readings], th)
    if plan.torch and plan.allreduce:
        rows += judge.allreduce(figures.get("allreduce") or {"correct": False, "error": error or "not measured"}, th)
    return NodeReport(rows)


__all__ = ["SHM_DIR", "CheckPlan", "NodeReport", "run_check"]
