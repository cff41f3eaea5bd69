"""Counting CUDA devices without torch (``elasticrun.launch.gpus``), as torchrun's ``gpu``/``auto`` count them.

The pure parts are checked against torch's own functions on the same inputs; the driver readers
against a fake ``/proc/driver/nvidia/gpus`` tree and a fake ``libnvidia-ml`` built for the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest

from elasticrun.errors import ConfigError
from elasticrun.launch.config import parse_nproc
from elasticrun.launch.gpus import (
    DriverGpus,
    count_visible,
    describe_gpus,
    nvml_gpus,
    parse_visible_devices,
    proc_gpus,
    uuids_to_ordinals,
    visible_accelerators,
    visible_gpu_count,
)
from elasticrun.launch.node import accelerators, uses_gpu

from helpers.fakelibs import NVML, build

pytestmark = pytest.mark.integration  # starts etcd or processes

UUIDS = ("GPU-aaaa-1111", "GPU-aabb-2222", "GPU-cccc-3333", "GPU-dddd-4444")
FOUR = DriverGpus(UUIDS, "test")
VALUES = [None, "", "-1", "0", "0,2", " 1, 3", "1gpu2,2ampere", "0,1,-1,3", "0,0", "2,x,1", "+1", "GPU-aaaa",
          "GPU-aaaa-1111,GPU-cccc", "GPU-cccc,3", "GPU-dd,GPU-dd", "MIG-1234", "MIG-1,MIG-2", "nonsense"]


@pytest.mark.parametrize("value", VALUES)
def test_visible_devices_are_parsed_like_torch(value: Optional[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.cuda

    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert parse_visible_devices(value) == torch.cuda._parse_visible_devices()


@pytest.mark.parametrize("candidates", [["GPU-aaaa-1111"], ["GPU-aa"], ["GPU-cc", "GPU-dd"],
                                        ["GPU-dd", "GPU-x", "GPU-aaaa"], ["GPU-cc", "GPU-cccc-3333"], []])
def test_uuid_entries_map_to_ordinals_like_torch(candidates: List[str]) -> None:
    import torch.cuda

    assert uuids_to_ordinals(candidates, UUIDS) == torch.cuda._transform_uuid_to_ordinals(candidates, list(UUIDS))


@pytest.mark.parametrize("value,want", [
    (None, 4), ("", 0), ("-1", 0), ("0,2", 2), ("0,5,1", 1), ("3,2,1,0", 4), ("1,1", 0), ("GPU-cccc", 1),
    ("GPU-aa", 0), ("GPU-dddd-4444,GPU-aaaa", 2), ("GPU-x,GPU-aaaa", 0), ("MIG-0d8c,MIG-77ab", 1),
])
def test_count_of_a_four_gpu_node(value: Optional[str], want: int) -> None:
    assert count_visible(parse_visible_devices(value), FOUR) == want
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert visible_gpu_count(env, FOUR) == want


def test_no_driver_or_no_gpu_counts_none() -> None:
    assert count_visible(list(range(64)), None) == 0
    assert count_visible(list(range(64)), DriverGpus((), "nvml")) == 0
    assert count_visible(["MIG-1"], DriverGpus((), "nvml")) == 0


def test_proc_directory_of_the_driver(tmp_path: Path) -> None:
    root = tmp_path / "gpus"
    assert proc_gpus(str(root)) is None, "no directory: no driver"
    for bus, uuid in (("0000:86:00.0", "GPU-86"), ("0000:3b:00.0", "GPU-3b"), ("0000:af:00.0", None)):
        (root / bus).mkdir(parents=True)
        if uuid:
            (root / bus / "information").write_text(f"Model: \t\t NVIDIA H100\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\n"
                                                    f"Bus Location: \t {bus}\n")
    (root / "stray-file").write_text("")
    gpus = proc_gpus(str(root))
    assert gpus is not None and gpus.uuids == ("GPU-3b", "GPU-86", ""), "PCI bus order, unknown UUID empty"
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-86"}, gpus) == 1
    assert visible_gpu_count({}, gpus) == 3
    # The node record: the model where the driver names it, no memory (/proc does not say).
    assert visible_accelerators({"CUDA_VISIBLE_DEVICES": "GPU-86,GPU-3b"}, gpus) == [
        {"type": "gpu", "index": 0, "name": "NVIDIA H100"}, {"type": "gpu", "index": 1, "name": "NVIDIA H100"}]
    assert visible_accelerators({"CUDA_VISIBLE_DEVICES": "2"}, gpus) == [{"type": "gpu", "index": 0,
                                                                        "name": "unknown GPU"}]


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build(tmp_path_factory.mktemp("nvml"), "libnvidia-ml.so.1", NVML)


def test_nvml_through_ctypes(fake_nvml: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVML_UUIDS", "GPU-one,GPU-two")
    monkeypatch.setenv("FAKE_NVML_NAMES", "NVIDIA H200,NVIDIA A10")
    monkeypatch.setenv("FAKE_NVML_MEMORY", f"{150_754_820_096},{24 * 2**30}")
    gpus = nvml_gpus(fake_nvml)
    assert gpus == DriverGpus(("GPU-one", "GPU-two"), "nvml", ("NVIDIA H200", "NVIDIA A10"),
                              (150_754_820_096, 24 * 2**30))
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "1,0,2"}, gpus) == 2
    # Each visible device in the worker's order (CUDA_VISIBLE_DEVICES), as torch.cuda would number it.
    assert visible_accelerators({"CUDA_VISIBLE_DEVICES": "1,0,2"}, gpus) == [
        {"type": "gpu", "index": 0, "name": "NVIDIA A10", "memory_gib": 24.0},
        {"type": "gpu", "index": 1, "name": "NVIDIA H200", "memory_gib": 140.4}]
    monkeypatch.delenv("FAKE_NVML_MEMORY")
    monkeypatch.delenv("FAKE_NVML_NAMES")
    unnamed = nvml_gpus(fake_nvml)
    assert unnamed is not None and unnamed.names == ("", "") and unnamed.memory == (0, 0)
    assert visible_accelerators({}, unnamed)[0] == {"type": "gpu", "index": 0, "name": "unknown GPU"}
    monkeypatch.delenv("FAKE_NVML_UUIDS")
    assert nvml_gpus(fake_nvml) is None, "nvmlInit failed: no answer"
    assert nvml_gpus(str(Path(fake_nvml).parent / "missing.so")) is None


def test_this_host_agrees_with_torch() -> None:
    import torch

    assert visible_gpu_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


@pytest.mark.parametrize("value,want", [("0,2", [0, 2]), ("GPU-dddd,GPU-aaaa-1111", [3, 0]), ("", []),
                                        ("MIG-0d8c", ["MIG instance"])])
def test_accelerators_name_each_visible_device(value: str, want: list) -> None:
    four = DriverGpus(UUIDS, "test", ("A", "B", "C", "D"), (2**30, 2 * 2**30, 3 * 2**30, 4 * 2**30))
    described = describe_gpus(parse_visible_devices(value), four)
    if want and want[0] == "MIG instance":
        assert described == [{"type": "gpu", "index": 0, "name": "MIG instance"}]
        return
    assert described == [{"type": "gpu", "index": i, "name": "ABCD"[o], "memory_gib": float(o + 1)}
                         for i, o in enumerate(want)]
    assert describe_gpus(parse_visible_devices(value), None) == []


def test_the_node_record_needs_no_torch_on_this_host() -> None:
    code = ("import sys; from elasticrun.launch.node import accelerators, uses_gpu; g = uses_gpu('auto'); "
            "print(g, accelerators(g)[0]['type'], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    use_gpu, kind, torch_loaded = out.stdout.split()
    assert torch_loaded == "False"
    gpus = visible_gpu_count()
    assert use_gpu == str(gpus > 0) and kind == ("gpu" if gpus else "cpu")
    assert uses_gpu("gpu") and not uses_gpu("cpu")
    assert accelerators(False) == [{"type": "cpu", "count": os.cpu_count() or 1}]


@pytest.mark.gpu
def test_this_gpu_host_agrees_with_torch() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    assert visible_gpu_count() == torch.cuda.device_count()
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0"}) == 1


def test_nproc_gpu_and_auto_without_importing_torch() -> None:
    code = ("import sys; from elasticrun.launch.config import parse_nproc; n, kind = parse_nproc('auto'); "
            "print(kind, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split()[1] == "False", "counting GPUs imported torch"
    if visible_gpu_count() == 0:
        assert out.stdout.split()[0] == "cpu"
        with pytest.raises(ConfigError, match="no CUDA GPU visible"):
            parse_nproc("gpu")
