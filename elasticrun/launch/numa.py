"""``--numa-binding``: the CPUs each local worker runs on, near its GPU, chosen as torchrun 2.13 does.

torchrun (``torch/numa/binding.py``) binds local rank ``r`` to CPUs near GPU ``r`` (the CUDA
ordinal, so ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` count); a mode picks which:

- ``node``: every CPU of the GPU's NUMA node;
- ``socket``: every CPU of every NUMA node on the GPU's socket;
- ``exclusive``: the node's physical cores split evenly between the node's GPUs (the lowest GPU
  ordinals get one more core when they do not divide), so no two workers share a core;
- ``core-complex``: one last-level-cache group of the node per GPU (the largest groups first).

Only CPUs this process may use count (its affinity). A GPU whose PCI device reports NUMA node
-1 (one-node machines) is on node 0. Everything that torchrun cannot work out is an error here
too, at the agent's start instead of at the first worker's: no CUDA driver or no GPU for a local
rank, a sysfs file missing, or fewer cores than GPUs on a node (``exclusive``). torch asks
``torch.cuda`` for each GPU's PCI address; here ``libcuda`` answers through ctypes
(``cuDeviceGetPCIBusId``: the same device order), so the agent needs no torch for it.

The binding itself is CPU affinity, as torchrun's ``numactl --physcpubind``: memory then comes
from the kernel's default policy, the node of the CPU that first touches it, i.e. the bound node.
No ``numactl`` is needed: a worker is bound after its fork (or by the exec shim of a fresh one),
before its script runs (:mod:`elasticrun.launch.warm`, :func:`elasticrun.proc.with_parent_death_signal`).

:func:`cpus_for_gpu` decides from a :class:`HostTopology` (pure); :func:`read_topology`,
:func:`gpu_numa_nodes` and :func:`pci_bus_ids` read sysfs and the driver.
"""

from __future__ import annotations

import ctypes
import enum
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, TypeVar

from elasticrun.errors import ConfigError

SYS = "/sys"
CUDA_LIBRARY = "libcuda.so.1"
CUDA_ERROR_NO_DEVICE = 100
FLAG = "--numa-binding"
T = TypeVar("T")


class AffinityMode(str, enum.Enum):
    """torchrun's ``--numa-binding`` modes."""

    NODE = "node"
    SOCKET = "socket"
    EXCLUSIVE = "exclusive"
    CORE_COMPLEX = "core-complex"


@dataclass(frozen=True)
class HostTopology:
    """What the modes decide from: sysfs and the GPUs' NUMA nodes, as plain values."""

    gpu_nodes: Tuple[int, ...]  # NUMA node of each visible GPU, by CUDA ordinal
    node_cpus: Mapping[int, FrozenSet[int]]  # NUMA node → its CPUs (allowed or not)
    allowed: FrozenSet[int]  # the CPUs this process may run on
    siblings: Mapping[int, FrozenSet[int]] = field(default_factory=dict)  # CPU → its physical core's CPUs
    socket_of: Mapping[int, int] = field(default_factory=dict)  # CPU → its socket (physical package)
    cache_of: Mapping[int, FrozenSet[int]] = field(default_factory=dict)  # CPU → CPUs sharing its last-level cache


def _fail(mode: AffinityMode, what: str) -> ConfigError:
    return ConfigError(f"{FLAG} {mode.value}: {what} (torchrun cannot bind here either); fix it or remove "
                       f"{FLAG}")


def _node_cpus(mode: AffinityMode, topo: HostTopology, node: int) -> FrozenSet[int]:
    """The allowed CPUs of NUMA node ``node``."""
    if node not in topo.node_cpus:
        raise _fail(mode, f"no CPU list for NUMA node {node} (/sys/devices/system/node/node{node}/cpulist)")
    return topo.node_cpus[node] & topo.allowed


def _lookup(mode: AffinityMode, table: Mapping[int, T], cpu: int, what: str) -> T:
    if cpu not in table:
        raise _fail(mode, f"the {what} of CPU {cpu} is unknown (/sys/devices/system/cpu/cpu{cpu})")
    return table[cpu]


def _gpus_of_node(topo: HostTopology, node: int) -> List[int]:
    return sorted(i for i, n in enumerate(topo.gpu_nodes) if n == node)


def _socket_cpus(mode: AffinityMode, topo: HostTopology, node: int) -> Set[int]:
    own = _node_cpus(mode, topo, node)
    if not own:
        raise _fail(mode, f"NUMA node {node} has no CPU this process may use")
    socket = _lookup(mode, topo.socket_of, min(own), "socket")
    cpus: Set[int] = set()
    for other in sorted(topo.node_cpus):
        theirs = _node_cpus(mode, topo, other)
        if theirs and _lookup(mode, topo.socket_of, min(theirs), "socket") == socket:  # CPU-less nodes: none
            cpus |= theirs
    return cpus


def _exclusive_cpus(mode: AffinityMode, topo: HostTopology, node: int, gpu: int) -> Set[int]:
    gpus = _gpus_of_node(topo, node)
    cores: Dict[int, Set[int]] = defaultdict(set)  # lowest CPU of a physical core → its allowed CPUs
    for cpu in _node_cpus(mode, topo, node):
        cores[min(_lookup(mode, topo.siblings, cpu, "core"))].add(cpu)
    ordered = [cores[k] for k in sorted(cores)]
    per_gpu, extra = divmod(len(ordered), len(gpus))
    if per_gpu < 1:
        raise _fail(mode, f"NUMA node {node} has {len(ordered)} physical cores for {len(gpus)} GPUs")
    index = gpus.index(gpu)
    start = index * per_gpu + min(index, extra)
    end = start + per_gpu + (1 if index < extra else 0)
    return {cpu for core in ordered[start:end] for cpu in core}


def _core_complex_cpus(mode: AffinityMode, topo: HostTopology, node: int, gpu: int) -> Set[int]:
    gpus = _gpus_of_node(topo, node)
    groups: Dict[int, Set[int]] = defaultdict(set)  # lowest CPU sharing a last-level cache → allowed CPUs
    for cpu in _node_cpus(mode, topo, node):
        groups[min(_lookup(mode, topo.cache_of, cpu, "last-level cache"))].add(cpu)
    if not groups:
        return set()
    ordered = [cpus for _, cpus in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))]
    return ordered[gpus.index(gpu) % len(ordered)]


def cpus_for_gpu(mode: AffinityMode, gpu: int, topo: HostTopology) -> FrozenSet[int]:
    """The CPUs the worker using GPU ``gpu`` is bound to in ``mode`` (torchrun's choice); ConfigError
    when the topology cannot say, or says nothing is left."""
    if not 0 <= gpu < len(topo.gpu_nodes):
        raise _fail(mode, f"local rank {gpu} has no GPU ({len(topo.gpu_nodes)} visible; torchrun binds local rank "
                    "r near GPU r)")
    node = topo.gpu_nodes[gpu]
    if mode is AffinityMode.NODE:
        cpus: Set[int] = set(_node_cpus(mode, topo, node))
    elif mode is AffinityMode.SOCKET:
        cpus = _socket_cpus(mode, topo, node)
    elif mode is AffinityMode.EXCLUSIVE:
        cpus = _exclusive_cpus(mode, topo, node, gpu)
    else:
        cpus = _core_complex_cpus(mode, topo, node, gpu)
    if not cpus:
        raise _fail(mode, f"no CPU left to bind GPU {gpu}'s worker to (NUMA node {node})")
    return frozenset(cpus)


# -- CPU lists ------------------------------------------------------------------------------------


def parse_cpu_list(text: str) -> Set[int]:
    """A sysfs CPU list (``"0-3,8,10-11"``) as a set."""
    cpus: Set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi) + 1) if sep else (int(lo),))
    return cpus


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The inverse of :func:`parse_cpu_list`: ``{0, 1, 2, 4}`` → ``"0-2,4"``."""
    ranges: List[str] = []
    for cpu in sorted(set(cpus)):
        if ranges and cpu == int(ranges[-1].rpartition("-")[2]) + 1:
            ranges[-1] = f"{ranges[-1].partition('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


# -- reading the host -----------------------------------------------------------------------------


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _normalized_bus_id(text: str) -> str:
    """``"0000:3B:00.0"`` as torch spells a GPU's PCI address: ``"0000:3b:00.0"`` (function 0)."""
    domain, bus, rest = text.strip().split(":")
    device = rest.partition(".")[0]
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.0"


def pci_bus_ids(mode: AffinityMode, library: str = CUDA_LIBRARY) -> List[str]:
    """The PCI address of every visible CUDA device, by ordinal, from the driver (``libcuda``)."""
    try:
        cuda = ctypes.CDLL(library)
    except OSError:
        raise _fail(mode, f"no CUDA driver on this node ({library} not found)") from None
    rc = int(cuda.cuInit(0))
    if rc == CUDA_ERROR_NO_DEVICE:
        return []
    if rc != 0:
        raise _fail(mode, f"the CUDA driver did not start (cuInit: CUDA error {rc})")
    count = ctypes.c_int(0)
    if int(cuda.cuDeviceGetCount(ctypes.byref(count))) != 0:
        raise _fail(mode, "the CUDA driver did not count its devices")
    ids = []
    for ordinal in range(count.value):
        device = ctypes.c_int(0)
        buf = ctypes.create_string_buffer(64)
        if int(cuda.cuDeviceGet(ctypes.byref(device), ordinal)) != 0 or int(
            cuda.cuDeviceGetPCIBusId(buf, len(buf), device)
        ) != 0:
            raise _fail(mode, f"the CUDA driver gave no PCI address for GPU {ordinal}")
        ids.append(_normalized_bus_id(buf.value.decode("ascii", "replace")))
    return ids


def gpu_numa_nodes(mode: AffinityMode, bus_ids: Sequence[str], sys_root: str = SYS) -> Tuple[int, ...]:
    """Each GPU's NUMA node from ``/sys/bus/pci/devices/<address>/numa_node`` (-1 counts as node 0)."""
    nodes = []
    for ordinal, bus_id in enumerate(bus_ids):
        text = _read(os.path.join(sys_root, "bus", "pci", "devices", bus_id, "numa_node"))
        try:
            nodes.append(max(int(str(text).strip()), 0))
        except ValueError:
            raise _fail(mode, f"no NUMA node for GPU {ordinal} (/sys/bus/pci/devices/{bus_id}/numa_node)") from None
    return tuple(nodes)


def _cpu_dir(sys_root: str, cpu: int) -> str:
    return os.path.join(sys_root, "devices", "system", "cpu", f"cpu{cpu}")


def _last_level_cache(sys_root: str, cpu: int) -> Optional[FrozenSet[int]]:
    """The CPUs sharing ``cpu``'s highest-level data or unified cache (None when sysfs has no caches)."""
    cache_dir = os.path.join(_cpu_dir(sys_root, cpu), "cache")
    try:
        entries = sorted(os.listdir(cache_dir))
    except OSError:
        return None
    best, shared = -1, None
    for entry in entries:
        if not entry.startswith("index") or not entry[5:].isdecimal():
            continue
        base = os.path.join(cache_dir, entry)
        kind, level, cpus = (_read(os.path.join(base, name)) for name in ("type", "level", "shared_cpu_list"))
        if kind is None or kind.strip() not in ("Unified", "Data") or level is None or cpus is None:
            continue
        if int(level) > best:
            best, shared = int(level), frozenset(parse_cpu_list(cpus))
    return shared


def _numa_nodes(sys_root: str) -> List[int]:
    base = os.path.join(sys_root, "devices", "system", "node")
    possible = _read(os.path.join(base, "possible"))
    if possible is not None:
        return sorted(parse_cpu_list(possible))
    try:
        return sorted(int(name[4:]) for name in os.listdir(base) if name.startswith("node") and name[4:].isdecimal())
    except OSError:
        return []


def read_topology(mode: AffinityMode, gpu_nodes: Sequence[int], sys_root: str = SYS,
                  allowed: Optional[Iterable[int]] = None) -> HostTopology:
    """What ``mode`` needs from sysfs (under ``sys_root``) for the allowed CPUs (default: this process's)."""
    cpus_allowed = frozenset(os.sched_getaffinity(0) if allowed is None else allowed)
    node_cpus: Dict[int, FrozenSet[int]] = {}
    for node in _numa_nodes(sys_root):
        text = _read(os.path.join(sys_root, "devices", "system", "node", f"node{node}", "cpulist"))
        if text is not None:
            node_cpus[node] = frozenset(parse_cpu_list(text))
    siblings: Dict[int, FrozenSet[int]] = {}
    socket_of: Dict[int, int] = {}
    cache_of: Dict[int, FrozenSet[int]] = {}
    for cpu in sorted(cpus_allowed):
        topology = os.path.join(_cpu_dir(sys_root, cpu), "topology")
        if mode is AffinityMode.EXCLUSIVE:
            text = _read(os.path.join(topology, "thread_siblings_list"))
            if text is not None:
                siblings[cpu] = frozenset(parse_cpu_list(text))
        elif mode is AffinityMode.SOCKET:
            text = _read(os.path.join(topology, "physical_package_id"))
            if text is not None:
                socket_of[cpu] = int(text)
        elif mode is AffinityMode.CORE_COMPLEX:
            shared = _last_level_cache(sys_root, cpu)
            if shared is not None:
                cache_of[cpu] = shared
    return HostTopology(tuple(gpu_nodes), node_cpus, cpus_allowed, siblings, socket_of, cache_of)


def worker_cpus(mode: AffinityMode, nproc: int, sys_root: str = SYS,
                cuda_library: str = CUDA_LIBRARY) -> Dict[int, FrozenSet[int]]:
    """Local rank → the CPUs its worker is bound to, for ``nproc`` workers on this node."""
    bus_ids = pci_bus_ids(mode, cuda_library)
    if nproc > len(bus_ids):
        raise _fail(mode, f"local rank {len(bus_ids)} has no GPU ({len(bus_ids)} visible; torchrun binds local "
                    "rank r near GPU r)")
    topo = read_topology(mode, gpu_numa_nodes(mode, bus_ids, sys_root), sys_root)
    return {rank: cpus_for_gpu(mode, rank, topo) for rank in range(nproc)}


def describe_binding(mode: AffinityMode, cpus: Mapping[int, FrozenSet[int]]) -> str:
    """One line for the agent's log: ``NUMA binding (node): local rank 0 → CPUs 0-15; 1 → CPUs 16-31``."""
    ranks = "; ".join(f"{rank} → CPUs {format_cpu_list(cpus[rank])}" for rank in sorted(cpus))
    return f"NUMA binding ({mode.value}): local rank {ranks}"


__all__ = ["AffinityMode", "HostTopology", "cpus_for_gpu", "describe_binding", "format_cpu_list", "gpu_numa_nodes",
           "parse_cpu_list", "pci_bus_ids", "read_topology", "worker_cpus"]
