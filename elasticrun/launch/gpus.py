"""How many CUDA devices a worker of this node will see, without importing torch.

torchrun's ``--nproc-per-node gpu`` (and ``auto`` on a GPU host) starts one worker per device
``torch.cuda.device_count()`` reports. That count is the driver's GPUs as filtered by
``CUDA_VISIBLE_DEVICES``; this module computes it the way torch's NVML-based count does
(``torch.cuda._device_count_nvml``), from what the driver says without CUDA or torch:

- ``CUDA_VISIBLE_DEVICES`` (:func:`parse_visible_devices`): unset means every GPU; a list of
  ordinals is read like the driver's ``strtoul`` (``"1gpu2"`` is 1) and ends at the first
  negative or empty entry (so ``""`` and ``"-1"`` hide every GPU); ``GPU-<uuid>`` entries (or
  unique prefixes of one) are matched against the driver's UUIDs; a repeated entry hides every
  GPU, as CUDA does. ``MIG-<uuid>`` entries give one device: a CUDA process enumerates a single
  MIG instance.
- the driver's GPUs (:class:`DriverGpus`, in its PCI bus order): NVML through ctypes
  (``libnvidia-ml.so.1``: ``nvmlInit``, ``nvmlDeviceGetCount``, ``nvmlDeviceGetUUID``, and for the
  node record ``nvmlDeviceGetName``, ``nvmlDeviceGetMemoryInfo``) when the library loads and
  initializes, else ``/proc/driver/nvidia/gpus/<bus id>/information`` (UUID and model, no memory);
  neither means no NVIDIA driver, so no GPU.

The node record's ``accelerators`` (:func:`visible_accelerators`) name each visible device and its
memory the same way, in the order the driver lists them (CUDA's own order with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``; its default puts the fastest first, which only differs on a node
with mixed GPU models).

The decisions (:func:`parse_visible_devices`, :func:`uuids_to_ordinals`, :func:`count_visible`,
:func:`visible_ordinals`, :func:`describe_gpus`) are pure; :func:`nvml_gpus` and :func:`proc_gpus`
read the driver.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from elasticrun.errors import ConfigError

VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
NVML_LIBRARY = "libnvidia-ml.so.1"
PROC_GPUS = "/proc/driver/nvidia/gpus"
ALL_ORDINALS = 64  # what an unset CUDA_VISIBLE_DEVICES stands for before the driver's count trims it
MIG_PREFIX = "MIG-"
GPU_PREFIX = "GPU-"

Visible = Union[List[int], List[str]]


@dataclass(frozen=True)
class DriverGpus:
    """The GPUs the NVIDIA driver knows, in its order (NVML's indices: PCI bus order)."""

    uuids: Tuple[str, ...]  # ``GPU-...`` per GPU ("" where the driver did not say)
    source: str  # "nvml" or the /proc directory read
    names: Tuple[str, ...] = ()  # the model per GPU ("" or absent where the driver did not say)
    memory: Tuple[int, ...] = ()  # total memory per GPU in bytes (0 or absent: unknown; /proc does not say)

    @property
    def count(self) -> int:
        return len(self.uuids)


def _strtoul(text: str) -> int:
    """The integer ``text`` starts with (an optional sign, then digits), or -1 when it has none."""
    end = 0
    for i, char in enumerate(text):
        if char.isdigit() or (i == 0 and char in "+-"):
            end = i + 1
        else:
            break
    try:
        return int(text[:end])
    except ValueError:  # "", "+" or "-" alone
        return -1


def _prefixed(value: str, prefix: str) -> List[str]:
    """The leading entries of ``value`` that start with ``prefix``; a repeated one hides every GPU."""
    found: List[str] = []
    for entry in value.split(","):
        if entry in found:
            return []
        if not entry.startswith(prefix):
            break
        found.append(entry)
    return found


def parse_visible_devices(value: Optional[str]) -> Visible:
    """``CUDA_VISIBLE_DEVICES`` as CUDA reads it: ordinals, or ``GPU-``/``MIG-`` UUID entries.

    ``None`` (unset) stands for ordinals 0..63, trimmed later to the driver's count.
    """
    if value is None:
        return list(range(ALL_ORDINALS))
    if value.startswith(GPU_PREFIX):
        return _prefixed(value, GPU_PREFIX)
    if value.startswith(MIG_PREFIX):
        return _prefixed(value, MIG_PREFIX)
    ordinals: List[int] = []
    for entry in value.split(","):
        ordinal = _strtoul(entry.strip())
        if ordinal in ordinals:
            return []
        if ordinal < 0:
            break
        ordinals.append(ordinal)
    return ordinals


def uuids_to_ordinals(candidates: Sequence[str], uuids: Sequence[str]) -> List[int]:
    """The driver ordinals of UUID entries (a unique prefix of a UUID names it); stops at the first
    entry that names no GPU or several; a GPU named twice hides every GPU."""
    ordinals: List[int] = []
    for candidate in candidates:
        matches = [i for i, uuid in enumerate(uuids) if uuid and uuid.startswith(candidate)]
        if len(matches) != 1:
            break
        if matches[0] in ordinals:
            return []
        ordinals.append(matches[0])
    return ordinals


def count_visible(visible: Visible, driver: Optional[DriverGpus]) -> int:
    """How many devices a CUDA process sees, given its parsed ``CUDA_VISIBLE_DEVICES`` and the driver."""
    if not visible or driver is None or driver.count == 0:
        return 0
    if str(visible[0]).startswith(MIG_PREFIX):
        return 1  # CUDA enumerates one MIG instance per process
    return len(visible_ordinals(visible, driver))


def visible_ordinals(visible: Visible, driver: DriverGpus) -> List[int]:
    """The driver ordinals of the devices a CUDA process sees, in its device order (empty for a MIG
    instance: which GPU holds it is not in its UUID)."""
    if not visible or driver.count == 0:
        return []
    first = visible[0]
    if isinstance(first, str):
        if first.startswith(MIG_PREFIX):
            return []
        return uuids_to_ordinals([str(v) for v in visible], driver.uuids)
    ordinals: List[int] = []
    for ordinal in visible:
        if int(ordinal) >= driver.count:
            break  # the list ends at the first ordinal the driver does not have
        ordinals.append(int(ordinal))
    return ordinals


def describe_gpus(visible: Visible, driver: Optional[DriverGpus]) -> List[Dict[str, Any]]:
    """The node record's ``accelerators`` entry per visible device: ``type``, ``index`` (the device
    number a worker uses), ``name`` and ``memory_gib`` where the driver said."""
    if driver is None or count_visible(visible, driver) == 0:
        return []
    if str(visible[0]).startswith(MIG_PREFIX):
        return [{"type": "gpu", "index": 0, "name": "MIG instance"}]
    out: List[Dict[str, Any]] = []
    for index, ordinal in enumerate(visible_ordinals(visible, driver)):
        entry: Dict[str, Any] = {"type": "gpu", "index": index}
        name = driver.names[ordinal] if ordinal < len(driver.names) else ""
        entry["name"] = name or "unknown GPU"
        memory = driver.memory[ordinal] if ordinal < len(driver.memory) else 0
        if memory:
            entry["memory_gib"] = round(memory / 2**30, 1)
        out.append(entry)
    return out


def nvml_gpus(library: str = NVML_LIBRARY) -> Optional[DriverGpus]:
    """The driver's GPUs through NVML, or None when the library is missing or does not initialize."""
    try:
        nvml = ctypes.CDLL(library)
    except OSError:
        return None
    try:
        init = getattr(nvml, "nvmlInit_v2", None) or nvml.nvmlInit
        if init() != 0:
            return None
    except AttributeError:
        return None
    try:
        count = ctypes.c_uint(0)
        get_count = getattr(nvml, "nvmlDeviceGetCount_v2", None) or nvml.nvmlDeviceGetCount
        if get_count(ctypes.byref(count)) != 0:
            return None
        handles = [_nvml_handle(nvml, i) for i in range(count.value)]
        return DriverGpus(tuple(_nvml_text(nvml, "nvmlDeviceGetUUID", h) for h in handles), "nvml",
                          tuple(_nvml_text(nvml, "nvmlDeviceGetName", h) for h in handles),
                          tuple(_nvml_memory(nvml, h) for h in handles))
    except AttributeError:
        return None
    finally:
        shutdown = getattr(nvml, "nvmlShutdown", None)
        if shutdown is not None:
            shutdown()


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvml_handle(nvml: ctypes.CDLL, index: int) -> Optional[ctypes.c_void_p]:
    handle = ctypes.c_void_p()
    get_handle = getattr(nvml, "nvmlDeviceGetHandleByIndex_v2", None) or nvml.nvmlDeviceGetHandleByIndex
    return handle if get_handle(index, ctypes.byref(handle)) == 0 else None


def _nvml_text(nvml: ctypes.CDLL, function: str, handle: Optional[ctypes.c_void_p]) -> str:
    """A device's text property (UUID, name), ``""`` when NVML lacks the call or does not answer."""
    call = getattr(nvml, function, None)
    if handle is None or call is None:
        return ""
    buf = ctypes.create_string_buffer(96)
    if call(handle, buf, len(buf)) != 0:
        return ""
    return buf.value.decode("ascii", "replace")


def _nvml_memory(nvml: ctypes.CDLL, handle: Optional[ctypes.c_void_p]) -> int:
    """A device's total memory in bytes, 0 when NVML does not answer."""
    call = getattr(nvml, "nvmlDeviceGetMemoryInfo", None)
    memory = _NvmlMemory()
    if handle is None or call is None or call(handle, ctypes.byref(memory)) != 0:
        return 0
    return int(memory.total)


def _proc_field(information: str, name: str) -> str:
    """The value of ``name:`` in one ``/proc/driver/nvidia/gpus/<bus id>/information`` text."""
    for line in information.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def proc_gpus(root: str = PROC_GPUS) -> Optional[DriverGpus]:
    """The driver's GPUs from its /proc directory (one subdirectory per GPU, named by PCI bus id),
    or None when the directory is missing (no NVIDIA driver loaded)."""
    try:
        bus_ids = sorted(name for name in os.listdir(root) if os.path.isdir(os.path.join(root, name)))
    except OSError:
        return None
    texts = []
    for bus_id in bus_ids:
        try:
            with open(os.path.join(root, bus_id, "information")) as f:
                texts.append(f.read())
        except OSError:
            texts.append("")
    return DriverGpus(tuple(_proc_field(t, "GPU UUID") for t in texts), root,
                      tuple(_proc_field(t, "Model") for t in texts))


def driver_gpus() -> Optional[DriverGpus]:
    """NVML's view when it answers, else the driver's /proc directory, else None (no NVIDIA driver)."""
    return nvml_gpus() or proc_gpus()


def visible_gpu_count(environ: Optional[Mapping[str, str]] = None, driver: Optional[DriverGpus] = None) -> int:
    """The CUDA devices a worker started with ``environ`` (default ``os.environ``) sees.

    ``driver`` defaults to :func:`driver_gpus` (read only when ``CUDA_VISIBLE_DEVICES`` leaves
    any device visible).
    """
    env = os.environ if environ is None else environ
    visible = parse_visible_devices(env.get(VISIBLE_DEVICES))
    if not visible:
        return 0
    return count_visible(visible, driver if driver is not None else driver_gpus())


def visible_accelerators(environ: Optional[Mapping[str, str]] = None,
                         driver: Optional[DriverGpus] = None) -> List[Dict[str, Any]]:
    """The node record's ``accelerators``: one entry per CUDA device a worker started with ``environ``
    (default ``os.environ``) sees (:func:`describe_gpus`); empty without any."""
    env = os.environ if environ is None else environ
    visible = parse_visible_devices(env.get(VISIBLE_DEVICES))
    if not visible:
        return []
    return describe_gpus(visible, driver if driver is not None else driver_gpus())


def virtual_visible_device(local_rank: int, parent: Optional[str]) -> str:
    """``--virtual-local-rank``: the ``CUDA_VISIBLE_DEVICES`` of local rank ``local_rank``'s worker.

    torchrun's rule: entry ``local_rank`` of the agent's own ``CUDA_VISIBLE_DEVICES`` as written
    (split at commas, stripped), or the local rank itself when the agent's is unset.
    """
    if parent is None:
        return str(local_rank)
    entries = parent.split(",")
    if local_rank >= len(entries):
        raise ConfigError(f"--virtual-local-rank: local rank {local_rank} has no device in {VISIBLE_DEVICES}="
                          f"{parent!r} ({len(entries)} listed); list one per worker or lower --nproc-per-node")
    return entries[local_rank].strip()


__all__ = ["DriverGpus", "count_visible", "describe_gpus", "driver_gpus", "nvml_gpus", "parse_visible_devices",
           "proc_gpus", "uuids_to_ordinals", "virtual_visible_device", "visible_accelerators", "visible_gpu_count",
           "visible_ordinals"]
