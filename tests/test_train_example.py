"""examples/train.py as real processes: plain python, and a 2-rank gloo job with a real etcd
(checkpoint request answered, progress reported, SIGTERM to one rank stops both at the same
step with a checkpoint, and the job resumes from it at another world size)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Dict, List

import pytest

from elasticrun.store.client import connect
from elasticrun.store.server import EtcdServer, free_port

from helpers.procs import wait_until as wait_for

pytestmark = pytest.mark.integration  # starts etcd or processes

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.py"


def base_env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "TORCHELASTIC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_single(args: List[str], cwd: Path, timeout: float = 90) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=cwd, env=base_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_single_process_trains_and_checkpoints(tmp_path: Path):
    out = run_single(["--epochs", "1", "--dataset-size", "512", "--ckpt-every", "5"], tmp_path)
    lines = re.finditer(r"^step (\d+) loss (\S+) world (\d+)$", out, re.M)
    steps = [(int(m[1]), float(m[2]), int(m[3])) for m in lines]
    assert [s for s, _, _ in steps] == list(range(1, 17)) and {w for _, _, w in steps} == {1}
    assert steps[-1][1] < steps[0][1], "the loss goes down"
    assert re.search(r"^done: steps=16 world=1 final_loss=[0-9.]+$", out, re.M)
    names = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert names == ["step-00000010", "step-00000015", "step-00000016"], "keep_last=3"


def test_a_second_run_of_a_finished_job_says_it_has_nothing_to_train(tmp_path: Path):
    """The quickstart twice in the same directory: the second run resumes the finished run, and says so."""
    args = ["--epochs", "1", "--dataset-size", "256", "--ckpt-every", "0"]
    first = run_single(args, tmp_path)
    assert "nothing to train" not in first and re.search(r"^done: steps=8 ", first, re.M), first
    second = run_single(args, tmp_path)
    assert not re.search(r"^step \d+ ", second, re.M), second  # no step trained
    said = [ln for ln in second.splitlines() if ln.startswith("nothing to train:")]
    assert len(said) == 1 and "resumed step-00000008" in said[0] and "--epochs 1" in said[0], second
    assert "--ckpt-dir" in said[0], said[0]


@pytest.fixture
def server(etcd_server: EtcdServer) -> EtcdServer:
    """The session's real etcd (conftest)."""
    return etcd_server


def test_two_ranks_request_progress_sigterm_and_resume(tmp_path: Path, server: EtcdServer):
    job = f"job-{uuid.uuid4().hex[:6]}"
    port = free_port()
    ckpt = tmp_path / "ckpts"
    procs, logs = [], []
    for rank in range(2):
        env = base_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), ELASTICRUN_ROUND="1",
                       ELASTICRUN_PREV_WORLD_SIZE="0", ELASTICRUN_RESCALE_TYPE="Start",
                       ELASTICRUN_RDZV_ENDPOINT=server.endpoint, ELASTICRUN_RDZV_ID=job,
                       ELASTICRUN_NODE_ID="node0", ELASTICRUN_CHECKPOINT_DIR=str(ckpt))
        log = open(tmp_path / f"rank{rank}.log", "w+")
        logs.append(log)
        cmd = [sys.executable, str(EXAMPLE), "--epochs", "1000", "--step-sleep", "0.02", "--ckpt-every", "0",
               "--dataset-size", "256"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path))
    store = connect(server.endpoint)
    store.put_json(f"/elasticrun/{job}/topology", {"round": 1})  # the round these workers belong to (fencing)
    try:
        text = lambda r=0: (tmp_path / f"rank{r}.log").read_text()  # noqa: E731
        wait_for(lambda: re.search(r"^step 5 ", text(), re.M), 60, "rank 0 to train 5 steps")
        assert "start: round 1 Start world 2" in text()
        # `elasticrun ckpt save` writes a request; the job saves and answers
        store.put_json(f"/elasticrun/{job}/control/checkpoint/req1", {"request_id": "req1", "requested_at": 1.0})
        done = wait_for(lambda: store.get_json(f"/elasticrun/{job}/control/checkpoint-done/req1"), 20, "the answer")
        assert done["root"] == str(ckpt) and done["name"] == f"step-{done['step']:08d}"
        assert (ckpt / done["name"] / "metadata.json").exists()
        assert f"checkpoint {done['name']} saved" in text() and "(request)" in text()
        key = f"/elasticrun/{job}/progress/node0"
        kv = wait_for(lambda: (lambda kv: kv if kv and kv.json()["step"] >= 5 else None)(store.get(key)), 10,
                      "progress at step 5")
        prog = kv.json()
        assert kv.lease and prog["rank"] == 0 and prog["world_size"] == 2 and prog["samples_per_s"] > 0
        # SIGTERM to one rank only: both agree to stop at the same step, checkpoint, exit 143
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=30) for p in procs]
        assert codes == [143, 143], text(0)[-1500:] + text(1)[-1500:]
        m = re.search(r"^stopped: stop at step (\d+) world 2$", text(), re.M)
        assert m, text()[-1500:]
        stop_step = int(m[1])
        assert (ckpt / f"step-{stop_step:08d}" / "metadata.json").exists()
        assert "SIGTERM received" in text(1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for log in logs:
            log.close()
        store.close()
    # resume at world 1 from the stop checkpoint, and train across an epoch boundary (8 steps per epoch)
    out = run_single(["--ckpt-dir", str(ckpt), "--steps", str(stop_step + 10), "--epochs", "1000",
                      "--dataset-size", "256"], tmp_path)
    assert f"resumed step-{stop_step:08d} (saved at world 2)" in out
    steps = [int(m[1]) for m in re.finditer(r"^step (\d+) loss \S+ world 1$", out, re.M)]
    assert steps == list(range(stop_step + 1, stop_step + 11))
    assert f"done: steps={stop_step + 10} world=1" in out
    assert "lr 0.05 " in out and "lr 0.1 " in text()[:400], "linear LR scaling follows the world size"
