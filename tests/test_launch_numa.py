"""``--numa-binding``: the CPUs each local worker is bound to (``elasticrun.launch.numa``), against torch's own code.

torchrun's choice (``torch.numa.binding``) is run on the same topology as ours: its sysfs and CUDA
lookups are replaced by the test's topology, so both decide from identical inputs. The readers
run against fake sysfs trees, a fake ``libcuda`` built for the test, and this machine's /sys.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Dict, FrozenSet, Iterable, Mapping

import pytest

from elasticrun.errors import ConfigError
from elasticrun.launch.numa import (
    AffinityMode,
    HostTopology,
    cpus_for_gpu,
    describe_binding,
    format_cpu_list,
    gpu_numa_nodes,
    parse_cpu_list,
    pci_bus_ids,
    read_topology,
    worker_cpus,
)

from helpers.fakelibs import CUDA, build

pytestmark = pytest.mark.integration  # starts etcd or processes

MODES = list(AffinityMode)


def _fs(cpus: Iterable[int]) -> FrozenSet[int]:
    return frozenset(cpus)


def two_sockets(allowed: Iterable[int] = range(64)) -> HostTopology:
    """2 sockets × 2 NUMA nodes, 8 physical cores per node with 2 threads (c, c+32), two 4-core L3
    groups per node, 2 GPUs per node."""
    node_cpus = {n: _fs([*range(8 * n, 8 * n + 8), *range(32 + 8 * n, 32 + 8 * n + 8)]) for n in range(4)}
    siblings = {c: _fs({c % 32, c % 32 + 32}) for c in range(64)}
    socket_of = {c: (c % 32) // 16 for c in range(64)}
    cache_of = {c: _fs(x for x in range(64) if (x % 32) // 4 == (c % 32) // 4) for c in range(64)}
    return HostTopology((0, 0, 1, 1, 2, 2, 3, 3), node_cpus, _fs(allowed), siblings, socket_of, cache_of)


def uneven() -> HostTopology:
    """One node, 5 cores without SMT, 3 GPUs; L3 groups of 3 and 2 cores; a second node without GPUs."""
    node_cpus = {0: _fs(range(5)), 1: _fs(range(5, 8))}
    return HostTopology((0, 0, 0), node_cpus, _fs(range(8)), {c: _fs({c}) for c in range(8)},
                        {c: 0 for c in range(8)},
                        {c: _fs(range(3)) if c < 3 else _fs(range(3, 5)) if c < 5 else _fs(range(5, 8))
                         for c in range(8)})


TOPOLOGIES = {"two-sockets": two_sockets(), "restricted": two_sockets([*range(2, 13), *range(34, 40)]),
              "uneven": uneven()}


def torch_choice(topo: HostTopology, mode: AffinityMode, gpu: int, monkeypatch: pytest.MonkeyPatch) -> FrozenSet[int]:
    """What torch.numa.binding picks on ``topo`` (its sysfs and CUDA lookups answered from ``topo``)."""
    from torch.numa import binding

    def node_cpus(*, numa_node_index: int) -> set:
        if numa_node_index not in topo.node_cpus:
            raise RuntimeError(f"Could not determine CPUs corresponding to {numa_node_index=}.")
        return set(topo.node_cpus[numa_node_index])

    fakes = {
        "_get_numa_node_index_for_gpu_index": lambda *, gpu_index: topo.gpu_nodes[gpu_index],
        "_get_gpu_count": lambda: len(topo.gpu_nodes),
        "_get_cpu_indices_for_numa_node_MAYBE_NOT_ALLOWED": node_cpus,
        "_get_allowed_cpu_indices_for_current_thread": lambda: set(topo.allowed),
        "_get_logical_cpu_indices_sharing_same_physical_core_as": lambda *, logical_cpu_index: set(
            topo.siblings[logical_cpu_index]),
        "_get_socket_index_for_cpu": lambda *, cpu_index: topo.socket_of[cpu_index],
        "_get_logical_cpus_sharing_same_max_level_cache_as": lambda *, logical_cpu_index: set(
            topo.cache_of[logical_cpu_index]),
        "_get_systemwide_numa_node_indices": lambda: set(topo.node_cpus),
    }
    with monkeypatch.context() as m:
        for name, fake in fakes.items():
            m.setattr(binding, name, fake)
        options = binding.NumaOptions(affinity_mode=binding.AffinityMode(mode.value))
        return frozenset(binding._get_logical_cpus_to_bind_to(gpu_index=gpu, numa_options=options))


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_every_gpu_gets_the_cpus_torchrun_gives_it(name: str, mode: AffinityMode,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    topo = TOPOLOGIES[name]
    for gpu in range(len(topo.gpu_nodes)):
        try:
            want = torch_choice(topo, mode, gpu, monkeypatch)
        except ValueError:  # socket mode: min() over a NUMA node none of whose CPUs is allowed
            assert mode is AffinityMode.SOCKET
            want = _socket_without_cpuless_nodes(topo, gpu, monkeypatch)
        except (RuntimeError, ZeroDivisionError):  # torch cannot bind that GPU's worker either
            want = frozenset()
        if not want:  # torch refuses to bind to nothing ("Must bind to a non-empty set of CPU indices")
            with pytest.raises(ConfigError):
                cpus_for_gpu(mode, gpu, topo)
        else:
            assert cpus_for_gpu(mode, gpu, topo) == want, (name, mode, gpu)


def _socket_without_cpuless_nodes(topo: HostTopology, gpu: int, monkeypatch: pytest.MonkeyPatch) -> FrozenSet[int]:
    """torch's socket choice with the nodes it trips over (no allowed CPU: they add none) left out."""
    kept = {n: c for n, c in topo.node_cpus.items() if c & topo.allowed or n == topo.gpu_nodes[gpu]}
    try:
        return torch_choice(replace(topo, node_cpus=kept), AffinityMode.SOCKET, gpu, monkeypatch)
    except ValueError:  # the GPU's own node has no allowed CPU
        return frozenset()


def test_what_each_mode_means_on_two_sockets() -> None:
    topo = two_sockets()
    gpu3 = {mode: cpus_for_gpu(mode, 3, topo) for mode in MODES}  # GPU 3: node 1, socket 0
    assert gpu3[AffinityMode.NODE] == {*range(8, 16), *range(40, 48)}
    assert gpu3[AffinityMode.SOCKET] == {*range(0, 16), *range(32, 48)}
    assert gpu3[AffinityMode.EXCLUSIVE] == {*range(12, 16), *range(44, 48)}, "the second half of node 1's cores"
    assert gpu3[AffinityMode.CORE_COMPLEX] == {*range(12, 16), *range(44, 48)}, "node 1's second L3 group"
    assert cpus_for_gpu(AffinityMode.EXCLUSIVE, 2, topo).isdisjoint(gpu3[AffinityMode.EXCLUSIVE])
    restricted = two_sockets([*range(2, 13), *range(34, 40)])
    assert cpus_for_gpu(AffinityMode.NODE, 0, restricted) == {*range(2, 8), *range(34, 40)}, "allowed CPUs only"


def test_uneven_cores_give_the_lowest_gpus_one_more() -> None:
    topo = uneven()
    assert [sorted(cpus_for_gpu(AffinityMode.EXCLUSIVE, g, topo)) for g in range(3)] == [[0, 1], [2, 3], [4]]
    assert [sorted(cpus_for_gpu(AffinityMode.CORE_COMPLEX, g, topo)) for g in range(3)] == [[0, 1, 2], [3, 4],
                                                                                             [0, 1, 2]]


@pytest.mark.parametrize("topo,mode,needle", [
    (HostTopology((0, 0), {0: _fs({0})}, _fs({0}), {0: _fs({0})}), AffinityMode.EXCLUSIVE,
     "1 physical cores for 2 GPUs"),
    (HostTopology((1,), {0: _fs({0})}, _fs({0})), AffinityMode.NODE, "no CPU list for NUMA node 1"),
    (HostTopology((0,), {0: _fs({4})}, _fs({0})), AffinityMode.NODE, "no CPU left"),
    (HostTopology((0,), {0: _fs({0})}, _fs({0})), AffinityMode.SOCKET, "the socket of CPU 0 is unknown"),
    (HostTopology((0,), {0: _fs({0})}, _fs({0})), AffinityMode.NODE, "local rank 1 has no GPU"),
])
def test_what_torchrun_cannot_bind_is_one_clear_error(topo: HostTopology, mode: AffinityMode, needle: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = 1 if "local rank 1" in needle else 0
    with pytest.raises(ConfigError, match=needle) as err:
        cpus_for_gpu(mode, gpu, topo)
    assert str(err.value).startswith(f"--numa-binding {mode.value}: ") and "\n" not in str(err.value)
    if gpu < len(topo.gpu_nodes):  # torch fails too, or picks nothing (which its validation refuses)
        try:
            assert not torch_choice(topo, mode, gpu, monkeypatch)
        except (RuntimeError, KeyError, ValueError):
            pass


def test_socket_mode_skips_a_node_without_cpus() -> None:
    """A memory-only NUMA node (CXL, HBM, a Grace Hopper GPU's memory) adds no CPU (torch's min() of
    nothing would raise there)."""
    topo = HostTopology((0,), {0: _fs({0, 1}), 1: _fs(())}, _fs({0, 1}), socket_of={0: 0, 1: 0})
    assert cpus_for_gpu(AffinityMode.SOCKET, 0, topo) == {0, 1}


@pytest.mark.parametrize("text", ["0", "0-3", "0-2,4,6-7", "1,3,5", "0-1\n", "", "8-11,0-3"])
def test_cpu_lists_read_and_written_like_torch(text: str) -> None:
    from torch.numa import binding

    cpus = parse_cpu_list(text)
    assert cpus == binding._get_set_of_int_from_ranges_str(text)
    assert format_cpu_list(cpus) == binding._get_ranges_str_from_ints(cpus)
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


def test_describe_binding_names_every_local_rank() -> None:
    line = describe_binding(AffinityMode.NODE, {1: _fs({4, 5, 6}), 0: _fs({0, 1, 2, 3, 8})})
    assert line == "NUMA binding (node): local rank 0 → CPUs 0-3,8; 1 → CPUs 4-6"


# -- readers --------------------------------------------------------------------------------------


def fake_sysfs(root: Path, topo: HostTopology, pci: Mapping[str, str]) -> None:
    """Write ``topo`` as sysfs files under ``root``; ``pci``: PCI address → its numa_node file's text."""
    node_dir = root / "devices" / "system" / "node"
    node_dir.mkdir(parents=True)
    (node_dir / "possible").write_text(format_cpu_list(topo.node_cpus) + "\n")
    for node, cpus in topo.node_cpus.items():
        (node_dir / f"node{node}").mkdir()
        (node_dir / f"node{node}" / "cpulist").write_text(format_cpu_list(cpus) + "\n")
    for cpu in sorted(set().union(*topo.node_cpus.values())):
        cpu_dir = root / "devices" / "system" / "cpu" / f"cpu{cpu}"
        (cpu_dir / "topology").mkdir(parents=True)
        (cpu_dir / "topology" / "thread_siblings_list").write_text(format_cpu_list(topo.siblings[cpu]) + "\n")
        (cpu_dir / "topology" / "physical_package_id").write_text(f"{topo.socket_of[cpu]}\n")
        caches: Dict[str, tuple] = {"index0": ("Data", 1, {cpu}), "index1": ("Instruction", 1, {cpu}),
                                    "index2": ("Unified", 2, topo.siblings[cpu]),
                                    "index3": ("Unified", 3, topo.cache_of[cpu])}
        for index, (kind, level, shared) in caches.items():
            (cpu_dir / "cache" / index).mkdir(parents=True)
            (cpu_dir / "cache" / index / "type").write_text(kind + "\n")
            (cpu_dir / "cache" / index / "level").write_text(f"{level}\n")
            (cpu_dir / "cache" / index / "shared_cpu_list").write_text(format_cpu_list(shared) + "\n")
    for address, node_text in pci.items():
        (root / "bus" / "pci" / "devices" / address).mkdir(parents=True)
        (root / "bus" / "pci" / "devices" / address / "numa_node").write_text(node_text + "\n")


PCI = {"0000:1b:00.0": "0", "0000:3b:00.0": "0", "0000:5b:00.0": "1", "0000:7b:00.0": "1",
       "0000:9b:00.0": "2", "0000:bb:00.0": "2", "0000:db:00.0": "3", "0000:fb:00.0": "3"}


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_read_topology_from_sysfs(tmp_path: Path, mode: AffinityMode) -> None:
    topo = two_sockets()
    fake_sysfs(tmp_path, topo, PCI)
    nodes = gpu_numa_nodes(mode, sorted(PCI), str(tmp_path))
    assert nodes == topo.gpu_nodes
    got = read_topology(mode, nodes, str(tmp_path), allowed=range(64))
    assert (got.gpu_nodes, got.node_cpus, got.allowed) == (topo.gpu_nodes, topo.node_cpus, topo.allowed)
    for gpu in range(8):
        assert cpus_for_gpu(mode, gpu, got) == cpus_for_gpu(mode, gpu, topo)


def test_a_gpu_on_node_minus_one_is_on_node_zero_and_a_missing_file_is_an_error(tmp_path: Path) -> None:
    fake_sysfs(tmp_path, uneven(), {"0000:01:00.0": "-1"})
    assert gpu_numa_nodes(AffinityMode.NODE, ["0000:01:00.0"], str(tmp_path)) == (0,)
    with pytest.raises(ConfigError, match=r"no NUMA node for GPU 1 \(/sys/bus/pci/devices/0000:02:00.0/numa_node\)"):
        gpu_numa_nodes(AffinityMode.NODE, ["0000:01:00.0", "0000:02:00.0"], str(tmp_path))


@pytest.fixture(scope="module")
def fake_cuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build(tmp_path_factory.mktemp("cuda"), "libcuda.so.1", CUDA)


def test_pci_addresses_come_from_libcuda_as_torch_spells_them(fake_cuda: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_PCI", "0000:3B:00.0,00000000:86:00.1")
    assert pci_bus_ids(AffinityMode.NODE, fake_cuda) == ["0000:3b:00.0", "0000:86:00.0"]
    monkeypatch.setenv("FAKE_CUDA_INIT_RC", "100")  # CUDA_ERROR_NO_DEVICE
    assert pci_bus_ids(AffinityMode.NODE, fake_cuda) == []
    monkeypatch.setenv("FAKE_CUDA_INIT_RC", "999")
    with pytest.raises(ConfigError, match=r"did not start \(cuInit: CUDA error 999\)"):
        pci_bus_ids(AffinityMode.NODE, fake_cuda)
    with pytest.raises(ConfigError, match="no CUDA driver on this node"):
        pci_bus_ids(AffinityMode.NODE, str(Path(fake_cuda).parent / "missing.so"))


def test_worker_cpus_from_the_driver_and_sysfs(tmp_path: Path, fake_cuda: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    mine = _fs(os.sched_getaffinity(0))
    elsewhere = _fs(range(4096, 4100))  # CPUs this process may not use
    every = sorted(mine | elsewhere)
    topo = HostTopology((0, 1), {0: elsewhere, 1: mine}, mine, {c: _fs({c}) for c in every}, dict.fromkeys(every, 0),
                        {c: mine if c in mine else elsewhere for c in every})
    fake_sysfs(tmp_path, topo, {"0000:3b:00.0": "0", "0000:86:00.0": "1"})
    monkeypatch.setenv("FAKE_CUDA_PCI", "0000:86:00.0")  # CUDA_VISIBLE_DEVICES=1: the GPU near our CPUs
    assert worker_cpus(AffinityMode.NODE, 1, str(tmp_path), fake_cuda) == {0: mine}
    with pytest.raises(ConfigError, match=r"local rank 1 has no GPU \(1 visible"):
        worker_cpus(AffinityMode.NODE, 2, str(tmp_path), fake_cuda)
    monkeypatch.setenv("FAKE_CUDA_PCI", "0000:86:00.0,0000:3B:00.0")
    with pytest.raises(ConfigError, match=r"no CPU left to bind GPU 1's worker to \(NUMA node 0\)"):
        worker_cpus(AffinityMode.NODE, 2, str(tmp_path), fake_cuda)


@pytest.mark.skipif(not Path("/sys/devices/system/node/node0/cpulist").exists(), reason="no NUMA sysfs")
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_this_machines_sysfs_gives_torchs_choice(mode: AffinityMode, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU on node 0 of this machine: our reading of the real /sys against torch's own."""
    from torch.numa import binding

    monkeypatch.setattr(binding, "_get_numa_node_index_for_gpu_index", lambda *, gpu_index: 0)
    monkeypatch.setattr(binding, "_get_gpu_count", lambda: 1)
    options = binding.NumaOptions(affinity_mode=binding.AffinityMode(mode.value))
    try:
        want = binding._get_logical_cpus_to_bind_to(gpu_index=0, numa_options=options)
    except (OSError, RuntimeError, ValueError):
        with pytest.raises(ConfigError):
            cpus_for_gpu(mode, 0, read_topology(mode, (0,)))
        return
    assert cpus_for_gpu(mode, 0, read_topology(mode, (0,))) == want
