"""Counting CUDA devices without torch (``elasticrun.launch.gpus``), as torchrun's ``gpu``/``auto`` count them.

The pure parts are checked against torch's own functions on the same inputs; the driver readers
against a fake ``/proc/driver/nvidia/gpus`` tree and a fake ``libnvidia-ml`` built for the test.
"""

from __future__ import annotations

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
    nvml_gpus,
    parse_visible_devices,
    proc_gpus,
    uuids_to_ordinals,
    visible_gpu_count,
)

from helpers.fakelibs import NVML, build

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


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build(tmp_path_factory.mktemp("nvml"), "libnvidia-ml.so.1", NVML)


def test_nvml_through_ctypes(fake_nvml: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVML_UUIDS", "GPU-one,GPU-two")
    gpus = nvml_gpus(fake_nvml)
    assert gpus == DriverGpus(("GPU-one", "GPU-two"), "nvml")
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "1,0,2"}, gpus) == 2
    monkeypatch.delenv("FAKE_NVML_UUIDS")
    assert nvml_gpus(fake_nvml) is None, "nvmlInit failed: no answer"
    assert nvml_gpus(str(Path(fake_nvml).parent / "missing.so")) is None


def test_this_host_agrees_with_torch() -> None:
    import torch

    assert visible_gpu_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


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
