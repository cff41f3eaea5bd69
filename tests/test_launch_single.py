"""One node: the torchrun environment, -m / --no-python, output prefixes, --log-dir, --redirects.

Real etcd (``--standalone`` or the session server), real worker processes; gloo where torch is involved,
NCCL in the test marked ``gpu`` (a GPU host: one worker per GPU).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elasticrun.checkpoint import list_checkpoints

from helpers.launch import ECHO, REPO, REPORT_ENV, SCRIPTS, reports, run_cli, worker_lines

pytestmark = pytest.mark.integration  # starts etcd or processes

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0  # read at collection: the host's GPUs
NCCL = dist.is_available() and dist.is_nccl_available()

TORCHRUN_VARS = [
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
]


def test_standalone_two_workers_get_the_torchrun_environment(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = run_cli(
        ["--standalone", "--rdzv-id", "envjob", "--node-id", "nodeA", "--nproc-per-node", "2",
         "--max-restarts", "2", REPORT_ENV, str(out)],
        env={"OMP_NUM_THREADS": None},  # the launcher must set it (N > 1 and unset)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = reports(out)
    assert [r["RANK"] for r in rows] == ["0", "1"], rows
    ports = {r["MASTER_PORT"] for r in rows}
    assert len(ports) == 1 and int(ports.pop()) > 0
    error_files = {r["TORCHELASTIC_ERROR_FILE"] for r in rows}
    assert len(error_files) == 2, "each rank needs its own error file"
    for r in rows:
        missing = [n for n in TORCHRUN_VARS if not r.get(n)]
        assert not missing, f"rank {r['RANK']} lacks {missing}"
        rank = int(r["RANK"])
        assert r["sum"] == r["expected_sum"] == 1.0  # all-reduce of ranks 0 + 1
        assert r["torchelastic"] is True  # torch.distributed.is_torchelastic_launched()
        assert r["LOCAL_RANK"] == r["ROLE_RANK"] == str(rank)
        assert r["GROUP_RANK"] == "0" and r["GROUP_WORLD_SIZE"] == "1"
        assert r["WORLD_SIZE"] == r["LOCAL_WORLD_SIZE"] == r["ROLE_WORLD_SIZE"] == "2"
        assert r["ROLE_NAME"] == "default"
        assert r["MASTER_ADDR"] == "127.0.0.1"
        assert r["TORCHELASTIC_RESTART_COUNT"] == "0" and r["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert r["TORCHELASTIC_RUN_ID"] == "envjob"
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert r["OMP_NUM_THREADS"] == "1"
        env = r["prefixed"]
        assert env["ELASTICRUN_ROUND"] == "0"
        assert env["ELASTICRUN_PREV_WORLD_SIZE"] == "0"
        assert env["ELASTICRUN_RESCALE_TYPE"] == "Start"
        assert env["ELASTICRUN_RDZV_ID"] == "envjob"
        assert env["ELASTICRUN_NODE_ID"] == "nodeA"
        assert env["ELASTICRUN_BACKEND"] == "gloo"
        assert re.fullmatch(r"127\.0\.0\.1:\d+", env["ELASTICRUN_RDZV_ENDPOINT"]), env["ELASTICRUN_RDZV_ENDPOINT"]
        assert os.path.basename(env["ELASTICRUN_RESCALE_EVENT_FILE"]) == "rescale_event.json"
        assert env["ELASTICRUN_LR_SCALING"] and env["ELASTICRUN_REDISTRIBUTION"]
    # The workers' gathered pids are the two processes that wrote the reports.
    assert sorted(g["pid"] for g in rows[0]["gathered"]) == sorted(r["pid"] for r in rows)
    assert "started a private etcd" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 1 or not NCCL, reason=f"needs a CUDA GPU and NCCL (this host: {GPUS} GPUs, "
                                                  f"NCCL {'yes' if NCCL else 'no'})")
def test_gpu_node_runs_one_nccl_worker_per_gpu_and_checkpoints(tmp_path: Path) -> None:
    """``--nproc-per-node gpu`` on this host: one worker per GPU, each bound to GPU LOCAL_RANK, nccl
    chosen by the agent, an all-reduce on the GPUs and a checkpoint of CUDA tensors saved and loaded
    back bit-identically (tests/scripts/gpu_check.py). One GPU: world 1 (no in-place re-forming)."""
    ckpt = tmp_path / "ckpt"
    proc = run_cli(["--standalone", "--nproc-per-node", "gpu", str(REPO / "tests" / "scripts" / "gpu_check.py"),
                    str(ckpt)], timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    ok = [ln for ln in proc.stdout.splitlines() if "GPU_CHECK_OK" in ln]
    assert len(ok) == GPUS and all(f"world={GPUS} " in ln and "backend=nccl" in ln for ln in ok), out
    assert [(c.name, c.latest) for c in list_checkpoints(str(ckpt))] == [("gpu-r0", True)]


def test_omp_num_threads_is_left_alone_when_set(tmp_path: Path, etcd_server) -> None:
    proc = run_cli(
        ["--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", f"omp-{os.getpid()}-{tmp_path.name}",
         "--nproc-per-node", "2", "--no-python", "/bin/sh", "-c", 'echo "omp=$OMP_NUM_THREADS"'],
        env={"OMP_NUM_THREADS": "3"},
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(worker_lines(proc.stdout, "omp=")) == [f"[{_host()}/0]:omp=3", f"[{_host()}/1]:omp=3"]


def test_module_mode_prefixes_output_and_passes_args(tmp_path: Path) -> None:
    proc = run_cli(
        ["--standalone", "--node-id", "nodeM", "--nproc-per-node", "2", "-m", "echo_worker",
         "--epochs", "3", "-x"],
        env={"PYTHONPATH": str(SCRIPTS)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = sorted(worker_lines(proc.stdout, "echo-out"))
    assert out == [
        "[nodeM/0]:echo-out rank=0 restart=0 world=2 args=['--epochs', '3', '-x']",
        "[nodeM/1]:echo-out rank=1 restart=0 world=2 args=['--epochs', '3', '-x']",
    ], proc.stdout
    err = sorted(worker_lines(proc.stderr, "echo-err"))
    assert err == ["[nodeM/0]:echo-err rank=0 restart=0", "[nodeM/1]:echo-err rank=1 restart=0"], proc.stderr


def test_no_python_runs_a_command(tmp_path: Path) -> None:
    proc = run_cli(
        ["--standalone", "--node-id", "nodeN", "--nproc-per-node", "2", "--no-python",
         "/bin/sh", "-c", 'echo "nopy rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK"'],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(worker_lines(proc.stdout, "nopy")) == [
        "[nodeN/0]:nopy rank=0 world=2 local=0",
        "[nodeN/1]:nopy rank=1 world=2 local=1",
    ], proc.stdout


def test_a_directory_with_main_runs_as_python_runs_it(tmp_path: Path) -> None:
    """``python DIR`` runs ``DIR/__main__.py`` with DIR first on sys.path; so does elasticrun (and torchrun)."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "helper.py").write_text("WHO = 'helper in the directory'\n")
    (app / "__main__.py").write_text(
        "import os, sys\nimport helper\nprint(f\"dir rank={os.environ['RANK']} {helper.WHO} argv={sys.argv[1:]}\")\n")
    proc = run_cli(["--standalone", "--node-id", "nodeD", str(app), "--lr", "0.1"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert worker_lines(proc.stdout, "dir") == ["[nodeD/0]:dir rank=0 helper in the directory argv=['--lr', '0.1']"]
    assert "(nnodes 1:1, 1 worker)" in proc.stderr  # one worker, not "1 workers"


def test_a_command_that_cannot_be_run_is_one_line_in_the_failure_report(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x7fELF not really")
    junk.chmod(0o755)
    proc = run_cli(["--standalone", "--no-python", str(junk)])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"elasticrun: cannot run {str(junk)!r}: Exec format error" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def _run_dir(logs: Path, job: str) -> Path:
    """``<log_dir>/<run_id>_<random>``: the one directory an agent made under --log-dir."""
    found = list(logs.glob(f"{job}_*"))
    assert len(found) == 1, list(logs.iterdir())
    return found[0]


def test_log_dir_has_files_per_attempt_per_rank(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = run_cli(
        ["--standalone", "--rdzv-id", "logjob", "--node-id", "nodeL", "--nproc-per-node", "2",
         "--max-restarts", "1", "--log-dir", str(logs), ECHO],
        env={"ECHO_FAIL_RANK_AT_RESTART": "1:0"},  # rank 1 exits 3 in attempt 0: a second attempt runs
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for attempt in (0, 1):
        for rank in (0, 1):
            d = _run_dir(logs, "logjob") / f"attempt_{attempt}" / str(rank)  # torchrun's layout
            assert (d / "stdout.log").read_text().startswith(f"echo-out rank={rank} restart={attempt} world=2")
            assert (d / "stderr.log").read_text() == f"echo-err rank={rank} restart={attempt}\n"
    # --log-dir alone does not take output off the console.
    assert "[nodeL/1]:echo-out rank=1 restart=1 world=2" in proc.stdout


def test_redirects_keep_worker_output_off_the_console(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = run_cli(
        ["--standalone", "--rdzv-id", "redir", "--nproc-per-node", "2", "--redirects", "3",
         "--log-dir", str(logs), ECHO],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "echo-out" not in proc.stdout + proc.stderr
    assert "echo-err" not in proc.stdout + proc.stderr
    for rank in (0, 1):
        d = _run_dir(logs, "redir") / "attempt_0" / str(rank)
        assert "echo-out" in (d / "stdout.log").read_text()
        assert "echo-err" in (d / "stderr.log").read_text()


def test_redirects_without_log_dir_keep_the_files(tmp_path: Path) -> None:
    proc = run_cli(["--standalone", "--rdzv-id", "redir2", "--nproc-per-node", "1", "--redirects", "1", ECHO])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "echo-out" not in proc.stdout  # stdout redirected ...
    assert "echo-err rank=0" in proc.stderr  # ... stderr still on the console
    m = re.search(r"worker logs in (\S+)", proc.stderr)
    assert m, proc.stderr
    log = _run_dir(Path(m.group(1)), "redir2") / "attempt_0" / "0" / "stdout.log"
    try:
        assert log.read_text().startswith("echo-out rank=0"), "redirected output must survive the agent"
    finally:
        shutil.rmtree(m.group(1), ignore_errors=True)


def _host() -> str:
    return socket.gethostname()
