"""The NVML reader against a stand-in library: a GPU with faults, a GPU without ECC, no NVML at all."""

from __future__ import annotations

from typing import Any, Dict

from elasticrun.health import judge, nvml
from elasticrun.health.thresholds import GIB, Thresholds
from elasticrun.health.verdict import Verdict

NOT_SUPPORTED = 3


class FakeNvml:
    """NVML's C functions as Python callables writing through the ctypes pointers they are given."""

    def __init__(self, gpus: Dict[int, Dict[str, Any]], init_ok: bool = True) -> None:
        self.gpus, self.init_ok, self.shut = gpus, init_ok, False

    def _gpu(self, handle: Any) -> Dict[str, Any]:
        return self.gpus[handle.value - 1]

    def nvmlInit_v2(self) -> int:
        return 0 if self.init_ok else 9

    def nvmlShutdown(self) -> int:
        self.shut = True
        return 0

    def nvmlDeviceGetCount_v2(self, out: Any) -> int:
        out._obj.value = len(self.gpus)
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index: int, out: Any) -> int:
        out._obj.value = index + 1
        return 0

    def nvmlDeviceGetName(self, handle: Any, buf: Any, size: int) -> int:
        buf.value = self._gpu(handle)["name"].encode()
        return 0

    def _value(self, handle: Any, key: str, out: Any) -> int:
        g = self._gpu(handle)
        if key not in g:
            return NOT_SUPPORTED
        out._obj.value = g[key]
        return 0

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int, out: Any) -> int:
        return self._value(handle, "temp", out)

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any, out: Any) -> int:
        return self._value(handle, "reasons", out)

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, kind: int, counter: int, out: Any) -> int:
        return self._value(handle, "ecc", out)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any, out: Any) -> int:
        return self._value(handle, "pending", out)

    def nvmlDeviceGetRemappedRows(self, handle: Any, corr: Any, unc: Any, pending: Any, failed: Any) -> int:
        g = self._gpu(handle)
        if "rows" not in g:
            return NOT_SUPPORTED
        corr._obj.value, unc._obj.value, pending._obj.value, failed._obj.value = g["rows"]
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle: Any, out: Any) -> int:
        out._obj.total, out._obj.free = self._gpu(handle)["mem"]
        return 0


def test_a_gpu_with_faults_and_a_healthy_one():
    lib = FakeNvml({
        0: {"name": "NVIDIA H100 80GB HBM3", "temp": 45, "reasons": 0x1, "ecc": 0, "rows": (2, 0, 0, 0),
            "mem": (80 * GIB, 79 * GIB)},
        1: {"name": "NVIDIA H100 80GB HBM3", "temp": 92, "reasons": 0x40, "ecc": 4, "rows": (0, 3, 1, 0),
            "mem": (80 * GIB, 10 * GIB)},
    })
    r0, r1 = nvml.read_from(lib, xid_wait_ms=0)
    assert (r0.name, r0.temperature_c, r0.retired_pages, r0.retirement_pending) == ("NVIDIA H100 80GB HBM3", 45.0,
                                                                                    0, False)
    assert (r1.ecc_uncorrected, r1.retired_pages, r1.retirement_pending, r1.throttle_reasons) == (4, 3, True, 0x40)
    assert lib.shut
    assert all(c.verdict is Verdict.PASS for c in judge.gpu(r0, Thresholds()))
    failed = {c.name for c in judge.gpu(r1, Thresholds()) if c.verdict is Verdict.FAIL}
    assert failed == {"gpu1 ecc uncorrected", "gpu1 retired pages", "gpu1 pending retirement", "gpu1 temperature",
                      "gpu1 clock throttling", "gpu1 memory free"}


def test_queries_a_gpu_does_not_support_are_left_out():
    r, = nvml.read_from(FakeNvml({0: {"name": "GeForce", "temp": 50, "mem": (8 * GIB, 8 * GIB)}}), xid_wait_ms=0)
    assert (r.ecc_uncorrected, r.retired_pages, r.retirement_pending, r.throttle_reasons) == (None,) * 4
    assert [c.name for c in judge.gpu(r, Thresholds())] == ["gpu0 temperature", "gpu0 memory free"]


def test_no_nvml_is_no_gpu_node():
    assert nvml.read_from(FakeNvml({}, init_ok=False)) is None
    assert nvml.read_gpus("libnvidia-ml-does-not-exist.so") is None
