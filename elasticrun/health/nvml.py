"""NVML readings for the node check, through ctypes (``libnvidia-ml.so.1``; no extra dependency, no torch).

:func:`read_gpus` returns one :class:`~elasticrun.health.judge.GpuReading` per GPU the driver has, or
``None`` when there is no NVML (no NVIDIA driver: not a GPU node). A query the GPU does not support
(retired pages on a GPU that remaps rows instead, ECC on a card without it) leaves its field None and
the judge skips it. XID errors are read from an NVML event set during a short window
(:data:`XID_WAIT_MS`): only errors that happen while the check runs can be seen this way.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, List, Optional

from elasticrun.health.judge import GpuReading

NVML_LIBRARY = "libnvidia-ml.so.1"
SUCCESS, INSUFFICIENT_SIZE = 0, 7
TEMPERATURE_GPU = 0
MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC = 1, 0
RETIRED_DOUBLE_BIT = 1
EVENT_XID_CRITICAL = 0x8
XID_WAIT_MS = 200


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _EventData(ctypes.Structure):
    _fields_ = [("device", ctypes.c_void_p), ("eventType", ctypes.c_ulonglong), ("eventData", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


def _fn(lib: Any, *names: str) -> Optional[Callable[..., int]]:
    for name in names:
        f = getattr(lib, name, None)
        if f is not None:
            return f
    return None


def _call(lib: Any, names: tuple, *args: Any) -> bool:
    f = _fn(lib, *names)
    return f is not None and f(*args) == SUCCESS


def _reading(lib: Any, index: int) -> GpuReading:
    handle = ctypes.c_void_p()
    if not _call(lib, ("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex"), index, ctypes.byref(handle)):
        return GpuReading(index=index, name="(NVML could not open this GPU)", memory_total=1, memory_free=0)
    buf = ctypes.create_string_buffer(96)
    name = buf.value.decode(errors="replace") if _call(lib, ("nvmlDeviceGetName",), handle, buf, 96) else "?"
    temp = ctypes.c_uint()
    reasons = ctypes.c_ulonglong()
    ecc = ctypes.c_ulonglong()
    pending = ctypes.c_int()
    pages = ctypes.c_uint(0)
    corr, unc, row_pending, row_failed = (ctypes.c_uint() for _ in range(4))
    mem = _Memory()
    get_pages = _fn(lib, "nvmlDeviceGetRetiredPages")
    has_pages = get_pages is not None and get_pages(handle, RETIRED_DOUBLE_BIT, ctypes.byref(pages),
                                                    None) in (SUCCESS, INSUFFICIENT_SIZE)  # 0 given: the count
    has_rows = _call(lib, ("nvmlDeviceGetRemappedRows",), handle, ctypes.byref(corr), ctypes.byref(unc),
                     ctypes.byref(row_pending), ctypes.byref(row_failed))
    has_pending = _call(lib, ("nvmlDeviceGetRetiredPagesPendingStatus",), handle, ctypes.byref(pending))
    retired: Optional[int] = None  # pages retired (older GPUs) plus rows remapped (A100 and later)
    if has_pages or has_rows:
        retired = (pages.value if has_pages else 0) + (unc.value if has_rows else 0)
    waiting: Optional[bool] = None  # a page or row waits for a GPU reset
    if has_pending or has_rows:
        waiting = bool(has_pending and pending.value) or bool(has_rows and row_pending.value)
    return GpuReading(
        index=index,
        name=name,
        temperature_c=float(temp.value) if _call(lib, ("nvmlDeviceGetTemperature",), handle, TEMPERATURE_GPU,
                                                 ctypes.byref(temp)) else None,
        throttle_reasons=int(reasons.value) if _call(
            lib, ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
            handle, ctypes.byref(reasons)) else None,
        ecc_uncorrected=int(ecc.value) if _call(lib, ("nvmlDeviceGetTotalEccErrors",), handle,
                                                MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC, ctypes.byref(ecc)) else None,
        retired_pages=retired,
        retirement_pending=waiting,
        remap_failed=bool(row_failed.value) if has_rows else None,
        memory_total=int(mem.total) if _call(lib, ("nvmlDeviceGetMemoryInfo",), handle, ctypes.byref(mem)) else None,
        memory_free=int(mem.free) if mem.total else None,
    )


def _xids(lib: Any, count: int, wait_ms: int) -> dict:
    """XID critical errors reported during ``wait_ms`` ({gpu index: [xid, ...]}; {} when unreadable)."""
    event_set = ctypes.c_void_p()
    if not _call(lib, ("nvmlEventSetCreate",), ctypes.byref(event_set)):
        return {}
    handles = {}
    try:
        for i in range(count):
            h = ctypes.c_void_p()
            if _call(lib, ("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex"), i, ctypes.byref(h)) and \
                    _call(lib, ("nvmlDeviceRegisterEvents",), h, ctypes.c_ulonglong(EVENT_XID_CRITICAL), event_set):
                handles[h.value] = i
        found: dict = {}
        data = _EventData()
        while handles and _call(lib, ("nvmlEventSetWait_v2", "nvmlEventSetWait"), event_set, ctypes.byref(data),
                                ctypes.c_uint(wait_ms)):
            found.setdefault(handles.get(data.device, -1), []).append(int(data.eventData))
            wait_ms = 0
        return found
    finally:
        _call(lib, ("nvmlEventSetFree",), event_set)


def read_gpus(library: str = NVML_LIBRARY, xid_wait_ms: int = XID_WAIT_MS) -> Optional[List[GpuReading]]:
    """Every GPU's readings, or None without an NVIDIA driver."""
    try:
        lib = ctypes.CDLL(library)
    except OSError:
        return None
    return read_from(lib, xid_wait_ms)


def read_from(lib: Any, xid_wait_ms: int = XID_WAIT_MS) -> Optional[List[GpuReading]]:
    """Every GPU's readings through ``lib`` (the loaded NVML library, or a stand-in with its functions)."""
    if not _call(lib, ("nvmlInit_v2", "nvmlInit")):
        return None
    try:
        count = ctypes.c_uint(0)
        if not _call(lib, ("nvmlDeviceGetCount_v2", "nvmlDeviceGetCount"), ctypes.byref(count)):
            return None
        readings = [_reading(lib, i) for i in range(count.value)]
        xids = _xids(lib, count.value, xid_wait_ms) if xid_wait_ms > 0 else {}
        return [GpuReading(**{**r.__dict__, "xid_errors": xids.get(r.index, [])}) for r in readings]
    finally:
        _call(lib, ("nvmlShutdown",))


__all__ = ["NVML_LIBRARY", "read_from", "read_gpus"]
