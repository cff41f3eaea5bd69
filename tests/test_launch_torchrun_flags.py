"""torchrun's worker flags against torchrun itself: --virtual-local-rank, --duplicate-*-filters, --numa-binding,
--logs-specs.

Both launchers run the same worker (tests/scripts/flags_worker.py: no torch) with the same flags; the
environment it sees and the filtered files they write are compared. CPU binding is checked in real
workers on every start path (forked, pre-warmed, fresh) through ``os.sched_getaffinity``; which CPUs
a mode picks is tests/test_launch_numa.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from elasticrun.launch.config import LaunchConfig, RendezvousConfig, WorkersConfig
from elasticrun.launch.workers import GroupState, WorkerGroup
from elasticrun.rendezvous.records import Member, Topology

from helpers.launch import SCRIPTS, assert_one_line_error, run_cli

pytestmark = pytest.mark.integration  # starts etcd or processes

WORKER = str(SCRIPTS / "flags_worker.py")
FLAGS = ["--standalone", "--nproc-per-node", "2", "--virtual-local-rank", "--tee", "3",
         "--duplicate-stdout-filters", "apple,orange,,pear", "--duplicate-stderr-filters", "kiwi"]
DEVICES = "3,5"  # the agent's CUDA_VISIBLE_DEVICES (no GPU is touched: the worker only reads it)


def _env(**extra: str) -> Dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def _records(out: Path) -> Dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))}


def _filtered(log_dir: Path, name: str) -> List[str]:
    """The lines of ``<log_dir>/<run>/attempt_0/<name>``, each without its worker prefix, sorted."""
    (path,) = log_dir.glob(f"*/attempt_0/{name}")
    return sorted(line.split("]:", 1)[1] for line in path.read_text().splitlines())


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Tuple[subprocess.CompletedProcess, Path]]:
    """torchrun and elasticrun, one run each with FLAGS: launcher → (its run, its directory)."""
    runs = {}
    for launcher in ("torchrun", "elasticrun"):
        where = tmp_path_factory.mktemp(launcher)
        (where / "out").mkdir()
        flags = [*FLAGS, "--log-dir", str(where / "logs"), WORKER, str(where / "out")]
        if launcher == "torchrun":
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", *flags], capture_output=True,
                                  text=True, timeout=300, env=_env(CUDA_VISIBLE_DEVICES=DEVICES),
                                  stdin=subprocess.DEVNULL)
        else:
            # --no-prewarm: the worker imports no torch, so a fork server's imports would only cost time here.
            proc = run_cli(["--no-prewarm", *flags], timeout=300, env={"CUDA_VISIBLE_DEVICES": DEVICES})
        assert proc.returncode == 0, f"{launcher}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        runs[launcher] = (proc, where)
    return runs


def test_virtual_local_rank_gives_each_worker_its_gpu_as_device_zero(both: Dict) -> None:
    theirs, ours = (_records(both[k][1] / "out") for k in ("torchrun", "elasticrun"))
    assert set(theirs) == set(ours) == {"rank0", "rank1"}
    for rank, device in (("rank0", "3"), ("rank1", "5")):
        assert (ours[rank]["LOCAL_RANK"], ours[rank]["CUDA_VISIBLE_DEVICES"]) == ("0", device)
        assert (theirs[rank]["LOCAL_RANK"], theirs[rank]["CUDA_VISIBLE_DEVICES"]) == ("0", device)
        assert ours[rank]["LOCAL_WORLD_SIZE"] == theirs[rank]["LOCAL_WORLD_SIZE"] == "2"
    assert [ours[r]["ELASTICRUN_LOCAL_RANK"] for r in ("rank0", "rank1")] == ["0", "1"], "the node's own index"


def test_filtered_lines_go_where_torchrun_puts_them(both: Dict) -> None:
    theirs, ours = (both[k][1] / "logs" for k in ("torchrun", "elasticrun"))
    want = sorted(f"{text} from {rank}" for rank in "01"
                  for text in ("apple pie", "orange,pear salad", "pineapple"))
    assert _filtered(theirs, "filtered_stdout.log") == want
    assert _filtered(ours, "filtered_stdout.log") == want
    assert _filtered(ours, "filtered_stderr.log") == _filtered(theirs, "filtered_stderr.log") == [
        "kiwi on stderr from 0", "kiwi on stderr from 1"]
    (path,) = ours.glob("*/attempt_0/filtered_stdout.log")
    assert all(line.startswith("[") and "/" in line.split("]:")[0] for line in path.read_text().splitlines()), \
        "each line after its worker's console prefix"
    proc = both["elasticrun"][0]
    assert proc.stdout.count("apple pie from") == 2, "--tee: the console still shows every line"


def test_a_filter_no_stream_feeds_leaves_an_empty_file_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = run_cli(["--no-prewarm", "--standalone", "--nproc-per-node", "2", "--tee", "1", "--local-ranks-filter", "0",
                    "--log-dir", str(tmp_path / "logs"), "--duplicate-stdout-filters", "apple",
                    "--duplicate-stderr-filters", "kiwi", WORKER, str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert _filtered(tmp_path / "logs", "filtered_stdout.log") == ["apple pie from 0", "pineapple from 0"], \
        "rank 1 is off the console (--local-ranks-filter 0): not copied, as in torchrun"
    assert _filtered(tmp_path / "logs", "filtered_stderr.log") == []
    assert "--duplicate-stderr-filters: no local rank's stderr is tee'd (--tee 2 or 3)" in proc.stderr


def test_virtual_local_rank_without_a_device_per_worker_is_one_line() -> None:
    proc = run_cli(["--standalone", "--nproc-per-node", "2", "--virtual-local-rank", WORKER, "/nonexistent"],
                   timeout=120, env={"CUDA_VISIBLE_DEVICES": "3"})
    assert proc.returncode == 2
    assert_one_line_error(proc, "--virtual-local-rank: local rank 1 has no device in CUDA_VISIBLE_DEVICES='3'")


def _cuda_driver() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


@pytest.mark.skipif(_cuda_driver(), reason="this host has a CUDA driver")
def test_numa_binding_without_a_gpu_fails_like_torchrun(tmp_path: Path) -> None:
    flags = ["--standalone", "--nproc-per-node", "1", "--numa-binding", "node", WORKER, str(tmp_path)]
    proc = run_cli(flags, timeout=120)
    assert proc.returncode == 2
    assert_one_line_error(proc, "--numa-binding node: no CUDA driver on this node", "remove --numa-binding")
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", *flags], capture_output=True, text=True,
                              timeout=300, env=_env(), stdin=subprocess.DEVNULL)
    assert torchrun.returncode != 0 and not list(tmp_path.glob("rank*.json")), "torchrun runs no worker either"


def test_a_custom_logs_specs_is_one_line_and_fails_under_torchrun_too(tmp_path: Path) -> None:
    flags = ["--standalone", "--logs-specs", "mine", WORKER, str(tmp_path)]
    proc = run_cli(flags, timeout=120)
    assert proc.returncode == 2
    assert_one_line_error(proc, "--logs-specs 'mine': only torchrun's default LogsSpecs ('default')")
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", *flags], capture_output=True, text=True,
                              timeout=300, env=_env(), stdin=subprocess.DEVNULL)
    assert torchrun.returncode != 0 and "Could not find entrypoint" in torchrun.stderr


# -- CPU binding in real workers -----------------------------------------------------------------


@pytest.mark.parametrize("path", ["forked", "pre-warmed", "fresh"])
def test_each_worker_runs_bound_to_its_cpus(tmp_path: Path, path: str) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    cpus = {0: frozenset({allowed[0]}), 1: frozenset({allowed[-1]})}
    cfg = LaunchConfig(rendezvous=RendezvousConfig(standalone=True),
                       workers=WorkersConfig(entrypoint=WORKER, args=[str(tmp_path)], nproc_per_node=2,
                                             standby=1 if path == "forked" else 0, prewarm=path != "fresh"))
    group = WorkerGroup(cfg, "n", str(tmp_path), None, False, on_exit=lambda: None)
    group.cpus = cpus
    member = Member("n", "h", "127.0.0.1", 2, 0, 0)
    topo = Topology(round=0, members=(member,), master_addr="127.0.0.1", master_port=1)
    try:
        group.prewarm()
        if group.server is not None:  # the first round does not wait for the server: let it come up
            assert group.server.wait_ready(120), group.server.why_gone
        group.start(topo, member, None)
        assert f"2 {path}" in group.started_how, group.started_how
        deadline = time.monotonic() + 180
        while group.poll() is GroupState.RUNNING and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group.poll() is GroupState.SUCCEEDED, group.failures()
    finally:
        group.stop(5)
        group.discard_warm()
    records = _records(tmp_path)
    for rank in (0, 1):
        seen = records[f"rank{rank}"]
        assert seen["affinity"] == sorted(cpus[rank]), (path, rank, seen)
        assert all(a == sorted(cpus[rank]) for a in seen["threads"].values()), "every thread is bound"
    assert sorted(os.sched_getaffinity(0)) == allowed, "the agent itself stays unbound"


@pytest.mark.gpu
@pytest.mark.parametrize("start", ["forked", "fresh"])
def test_numa_binding_on_this_gpu_host_is_torchruns_choice(tmp_path: Path, start: str) -> None:
    """The real path: libcuda's PCI address, the host's sysfs, the worker's affinity, against torch's choice."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from torch.numa import binding

    options = binding.NumaOptions(affinity_mode=binding.AffinityMode.NODE)
    want = sorted(binding._get_logical_cpus_to_bind_to(gpu_index=0, numa_options=options))
    flags = [] if start == "forked" else ["--no-prewarm"]
    proc = run_cli([*flags, "--standalone", "--nproc-per-node", "1", "--numa-binding", "node", WORKER,
                    str(tmp_path)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "NUMA binding (node): local rank 0 → CPUs" in proc.stderr
    assert _records(tmp_path)["rank0"]["affinity"] == want
