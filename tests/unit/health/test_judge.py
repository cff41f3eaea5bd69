"""The node check's judgements on made-up readings: a failing GPU as NVML would report it, slow storage."""

from __future__ import annotations

import pytest

from elasticrun.errors import ConfigError
from elasticrun.health import judge
from elasticrun.health.judge import GpuReading
from elasticrun.health.thresholds import GIB, Thresholds
from elasticrun.health.verdict import Verdict, summary

TH = Thresholds()


def healthy(**over: object) -> GpuReading:
    base = dict(index=0, name="NVIDIA H100 80GB HBM3", temperature_c=45.0, throttle_reasons=0x1, ecc_uncorrected=0,
                retired_pages=0, retirement_pending=False, remap_failed=False, memory_total=80 * GIB,
                memory_free=79 * GIB)
    base.update(over)
    return GpuReading(**base)  # type: ignore[arg-type]


def verdicts(rows):
    return {r.name: r.verdict for r in rows}


def test_a_healthy_gpu_passes_every_check():
    rows = judge.gpu(healthy(), TH)
    assert rows and all(r.verdict is Verdict.PASS for r in rows), rows


@pytest.mark.parametrize("fault, failed", [
    (dict(ecc_uncorrected=3), "gpu0 ecc uncorrected"),
    (dict(retired_pages=2), "gpu0 retired pages"),
    (dict(retirement_pending=True), "gpu0 pending retirement"),
    (dict(remap_failed=True), "gpu0 pending retirement"),
    (dict(temperature_c=91.0), "gpu0 temperature"),
    (dict(throttle_reasons=0x40 | 0x1), "gpu0 clock throttling"),
    (dict(throttle_reasons=0x8), "gpu0 clock throttling"),
    (dict(memory_free=20 * GIB), "gpu0 memory free"),
    (dict(xid_errors=[79]), "gpu0 xid errors"),
])
def test_each_nvml_fault_fails_its_check_and_only_it(fault, failed):
    rows = judge.gpu(healthy(**fault), TH)
    bad = [r.name for r in rows if r.verdict is Verdict.FAIL]
    assert bad == [failed]
    assert failed in summary(rows)


def test_idle_and_power_cap_throttling_is_not_a_fault():
    assert judge.throttle_names(0x1 | 0x2 | 0x4) == []
    assert judge.throttle_names(0x40) == ["hw thermal slowdown"]


def test_fields_the_driver_does_not_report_are_not_judged():
    rows = judge.gpu(GpuReading(index=1, name="x"), TH)
    assert rows == []


def test_gpu_matmul_against_expected_and_against_peers():
    rows = judge.gpu_matmuls([
        {"index": 0, "name": "NVIDIA H100 80GB HBM3", "tflops": 610.0},
        {"index": 1, "name": "NVIDIA H100 80GB HBM3", "tflops": 300.0},  # half speed: a sick GPU
        {"index": 2, "name": "NVIDIA H100 80GB HBM3", "tflops": None, "error": "RuntimeError: CUDA error"},
    ], TH)
    assert [r.verdict for r in rows] == [Verdict.PASS, Verdict.FAIL, Verdict.FAIL]
    assert "CUDA error" in rows[2].detail
    # an unknown model is judged against the node's best GPU only
    rows = judge.gpu_matmuls([{"index": 0, "name": "Mystery", "tflops": 10.0},
                              {"index": 1, "name": "Mystery", "tflops": 5.0}], TH)
    assert [r.verdict for r in rows] == [Verdict.PASS, Verdict.FAIL]


def test_expected_speed_prefers_the_longest_model_name():
    assert judge.expected_tflops("NVIDIA H100 PCIe") == 450.0
    assert judge.expected_tflops("NVIDIA H100 80GB HBM3") == 600.0
    assert judge.expected_tflops("Quadro P400") is None


def test_cpu_storage_etcd_and_allreduce():
    assert judge.cpu(1.0, TH)[0].verdict is Verdict.FAIL
    assert judge.cpu(None, TH, "torch missing")[0].detail == "torch missing"
    assert judge.cpu(20.0, TH)[0].verdict is Verdict.PASS
    rows = judge.storage("checkpoint dir", "/ck", int(0.5 * GIB), 500.0, TH.min_disk_free_gib, TH.min_disk_write_mbps)
    assert [r.verdict for r in rows] == [Verdict.FAIL, Verdict.PASS]
    rows = judge.storage("shm", "/dev/shm", None, None, 1, 1, "cannot write to /dev/shm: Read-only file system")
    assert all(r.verdict is Verdict.FAIL and "Read-only" in r.detail for r in rows)
    assert judge.etcd(None, TH, "")[0].verdict is Verdict.SKIP
    assert judge.etcd(None, TH, "h:1", "no answer")[0].verdict is Verdict.FAIL
    assert judge.etcd(250.0, TH, "h:1")[0].verdict is Verdict.FAIL
    assert judge.etcd(3.0, TH, "h:1")[0].verdict is Verdict.PASS
    assert judge.allreduce({"backend": "gloo", "world": 2, "correct": False}, TH)[0].verdict is Verdict.FAIL
    nccl = {"backend": "nccl", "world": 8, "correct": True, "gbps": 1.0}
    assert judge.allreduce(nccl, TH)[0].verdict is Verdict.FAIL
    gloo = {"backend": "gloo", "world": 2, "correct": True, "gbps": 0.05}
    assert judge.allreduce(gloo, TH)[0].verdict is Verdict.PASS


@pytest.mark.parametrize("name, raw, words", [
    ("min_cpu_gflops", "fast", "--min-cpu-gflops 'fast' is not a number"),
    ("max_etcd_rtt_ms", "-1", "must be a number >= 0"),
    ("min_gpu_free_fraction", "1.5", "is a fraction"),
    ("max_gpu_temp_c", "nan", "must be a number >= 0"),
])
def test_bad_threshold_values_are_one_line(name, raw, words):
    with pytest.raises(ConfigError, match=words):
        TH.with_overrides({name: raw})


def test_threshold_override():
    assert TH.with_overrides({"min_cpu_gflops": "7.5", "max_gpu_temp_c": None}).min_cpu_gflops == 7.5


def test_node_check_thresholds_list():
    th = TH.parse_list("min-cpu-gflops=20, max-gpu-temp-c=80,")
    assert (th.min_cpu_gflops, th.max_gpu_temp_c) == (20.0, 80.0)
    with pytest.raises(ConfigError, match="expected NAME=N with NAME one of"):
        TH.parse_list("cpu=3")
    with pytest.raises(ConfigError, match="--node-check-thresholds: --min-cpu-gflops 'x' is not a number"):
        TH.parse_list("min-cpu-gflops=x")
