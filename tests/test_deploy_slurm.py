"""deploy/slurm: the sbatch script and its per-node command, run with the SLURM_* environment of 2 nodes.

Slurm's own tools are shims on PATH (``scontrol`` names the nodes and records requeues, ``srun`` starts one
task per node with SLURM_NODEID set and forwards SIGTERM like srun does); etcd, the agents and the
workers are real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from elasticrun.job.exitcodes import ExitCode
from elasticrun.store.server import free_port

from helpers.launch import REPO, REPORT_ENV, reports
from helpers.procs import SCRIPTS, wait_until, worker_env

pytestmark = pytest.mark.integration  # starts etcd or processes

SLURM = REPO / "deploy" / "slurm"
NODES = 2

FAKE_SCONTROL = """#!/usr/bin/env bash
# scontrol show hostnames LIST: one line per node (all loopback here), a pause after the first as when a
# long list takes several writes (a reader that stops after line 1 kills us with SIGPIPE: node.sh must
# read it all); scontrol requeue ID: recorded.
case "$1 $2" in
  "show hostnames") for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do echo 127.0.0.1; sleep 0.2; done ;;
  requeue*) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
  *) echo "fake scontrol: unexpected $*" >&2; exit 1 ;;
esac
"""

FAKE_SRUN = """#!/usr/bin/env bash
# srun [--options] CMD ARGS: CMD once per node with that node's SLURM_NODEID; SIGTERM goes to every task;
# the exit code is the highest of the tasks' (as srun's).
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURMD_NODENAME=node$i "$@" > "$FAKE_SLURM_DIR/node$i.log" 2>&1 &
  pids+=($!)
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
rc=0
for pid in "${pids[@]}"; do
  while true; do
    wait "$pid"; code=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  (( code > rc )) && rc=$code
done
exit $rc
"""


def _slurm_env(tmp_path: Path, **extra: str) -> Dict[str, str]:
    shims = tmp_path / "bin"
    shims.mkdir(exist_ok=True)
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    return worker_env({
        "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[0-1]",
        "SLURM_JOB_NUM_NODES": str(NODES),
        "SLURM_NNODES": str(NODES),
        "FAKE_SLURM_LOG": str(tmp_path / "scontrol.log"),
        "FAKE_SLURM_DIR": str(tmp_path),
        "ELASTICRUN": f"{sys.executable} -m elasticrun",
        "NPROC_PER_NODE": "1",
        "RDZV_PORT": str(free_port()),
        "ELASTICRUN_EXTRA_ARGS": "--stability-window 0.5 --heartbeat-timeout 3",
        **extra,
    })


def _logs(tmp_path: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("node*.log")))


def test_node_command_forms_one_world_of_two_nodes(tmp_path: Path) -> None:
    """node.sh on each node: both meet at the first node's etcd (not a world of one each) and finish."""
    out = tmp_path / "out"
    out.mkdir()
    env = _slurm_env(tmp_path, SHUTDOWN_TIMEOUT="5")
    procs: List[subprocess.Popen] = []
    try:
        for i in range(NODES):
            node_env = {**env, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i), "SLURMD_NODENAME": f"node{i}"}
            log = open(tmp_path / f"node{i}.log", "wb")
            procs.append(subprocess.Popen([str(SLURM / "node.sh"), REPORT_ENV, str(out)], env=node_env,
                                          stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO)))
        codes = [p.wait(120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0], _logs(tmp_path)
    rows = reports(out)
    assert {(r["RANK"], r["WORLD_SIZE"], r["GROUP_WORLD_SIZE"]) for r in rows} == {("0", "2", "2"), ("1", "2", "2")}
    assert {r["ELASTICRUN_NODE_ID"] for r in rows} == {"node0", "node1"}
    assert {r["ELASTICRUN_RDZV_ID"] for r in rows} == {"slurm-4242"}
    assert "hosting the job's etcd" in (tmp_path / "node0.log").read_text()
    assert "hosting the job's etcd" not in (tmp_path / "node1.log").read_text()


def test_sbatch_notice_drains_and_requeues(tmp_path: Path) -> None:
    """The --signal notice (SIGTERM to the batch shell): every worker saves, agents exit 143, the job is requeued."""
    out = tmp_path / "out"
    out.mkdir()
    env = _slurm_env(tmp_path, SHUTDOWN_TIMEOUT="10")
    batch = subprocess.Popen(["bash", str(SLURM / "elasticrun.sbatch"), str(SCRIPTS / "term_saver.py"), str(out)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=str(REPO),
                             start_new_session=True)
    try:
        try:
            wait_until(lambda: (out / "0.pid").exists() and (out / "1.pid").exists(), 90,
                       "both ranks of the 2-node world to run")
        except AssertionError as err:
            raise AssertionError(f"{err}\n{_logs(tmp_path)}") from None
        batch.send_signal(signal.SIGTERM)
        text, _ = batch.communicate(timeout=60)
    finally:
        if batch.poll() is None:  # the test failed: stop the fake allocation (its own process group)
            os.killpg(batch.pid, signal.SIGTERM)
            try:
                batch.wait(30)
            finally:
                try:
                    os.killpg(batch.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                batch.wait()
    assert batch.returncode == ExitCode.DRAINED, text.decode() + _logs(tmp_path)
    for rank in (0, 1):
        assert (out / f"{rank}.SIGTERM").exists(), f"rank {rank} got no SIGTERM to save\n{_logs(tmp_path)}"
    assert (tmp_path / "scontrol.log").read_text().split("\n")[0] == "requeue 4242"
    assert "notice" in text.decode()


@pytest.mark.parametrize("requeued,max_requeues,expect_requeue", [("2", "3", True), ("3", "3", False)])
def test_sbatch_caps_requeues_of_a_permanent_transient_failure(
    tmp_path: Path, requeued: str, max_requeues: str, expect_requeue: bool
) -> None:
    """An etcd that never answers makes every start exit 138 (retryable): the job is requeued while
    SLURM_RESTART_COUNT is below MAX_REQUEUES, and then ends with 138, saying why in the job log."""
    env = _slurm_env(tmp_path, SLURM_RESTART_COUNT=requeued, MAX_REQUEUES=max_requeues,
                     ELASTICRUN_ETCD_ENDPOINTS=f"127.0.0.1:{free_port()}",  # nothing listens there
                     ELASTICRUN_ETCD_TIMEOUT="2")  # how long each start tries it (default 10 s)
    proc = subprocess.run(["bash", str(SLURM / "elasticrun.sbatch"), str(SCRIPTS / "echo_worker.py")], env=env,
                          capture_output=True, text=True, timeout=180, cwd=str(REPO))
    log = proc.stdout + proc.stderr
    assert proc.returncode == ExitCode.TRANSIENT, log + _logs(tmp_path)
    assert "cannot reach etcd" in _logs(tmp_path)
    assert f"requeued {requeued} of at most {max_requeues} time(s)" in log
    requeues = tmp_path / "scontrol.log"
    if expect_requeue:
        assert requeues.read_text() == "requeue 4242\n"
        assert f"requeueing job 4242 (requeue {int(requeued) + 1} of at most {max_requeues})" in log
    else:
        assert not requeues.exists(), requeues.read_text()
        assert (f"retryable exit code 138, but job 4242 was requeued {requeued} time(s) already "
                f"(MAX_REQUEUES={max_requeues}): not requeueing") in log


@pytest.mark.parametrize("bad", ["ten", "-1", "3.5"])
def test_sbatch_refuses_a_bad_max_requeues_before_starting_anything(tmp_path: Path, bad: str) -> None:
    env = _slurm_env(tmp_path, MAX_REQUEUES=bad)
    proc = subprocess.run(["bash", str(SLURM / "elasticrun.sbatch"), str(SCRIPTS / "echo_worker.py")], env=env,
                          capture_output=True, text=True, timeout=60, cwd=str(REPO))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"elasticrun.sbatch: MAX_REQUEUES='{bad}' is not a whole number; set it to the most requeues allowed (0: none)"]
    assert not list(tmp_path.glob("node*.log")), "nothing was started"
