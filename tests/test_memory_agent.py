"""Memory snapshots with real agents, etcd and gloo workers (examples/train.py).

- a worker SIGKILLed at step S: the job resumes from the agent's shared memory at a step
  >= S - N (N = the snapshot interval) although no disk checkpoint exists yet;
- the agent's shared-memory directory is 0700, and gone after the job ends and after a
  SIGKILL of the agent (its watchdog removes it);
- the example reports a memory cap that is too small in one line and trains on;
- two nodes: a scale-up resumes every rank at the memory step (the newcomer fetches it from
  its peer's memory); a node SIGKILLed resumes the survivor from its replica of the lost
  node's parts at the memory step, while the newest disk checkpoint is far older.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Callable, List

import psutil
import pytest

from elasticrun.store.server import EtcdServer

from helpers.procs import Agent, wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "train.py")
EVERY = 5


def _shm_dirs(job: str, agent: Agent) -> List[str]:
    return glob.glob(f"/dev/shm/elasticrun-snap-{job.replace('-', '_')}-*-{agent.pid}")


def _rank0_lines(agent: Agent) -> List[str]:
    return [m.group(1) for m in re.finditer(r"^\[[^\]/]+/0\]:(.*)$", agent.stdout(), re.M)]


def _last_step(agent: Agent) -> int:
    steps = [int(m.group(1)) for ln in _rank0_lines(agent) for m in [re.match(r"step (\d+) ", ln)] if m]
    return steps[-1] if steps else 0


def _start(agents: Callable[..., Agent], endpoint: str, job: str, ckpt: Path, *extra: str) -> Agent:
    return agents(
        ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint", endpoint, "--rdzv-id", job,
         "--node-id", "node0", "--max-restarts", "3", "--no-prewarm", "--shutdown-timeout", "3",
         EXAMPLE, "--epochs", "1000", "--dataset-size", "512", "--step-sleep", "0.05", "--ckpt-dir", str(ckpt),
         "--snapshot-every", str(EVERY), *extra],
        name="node0",
    )


def _worker(agent: Agent, rank: int) -> psutil.Process:
    for p in agent.descendants():
        try:
            if p.environ().get("RANK") == str(rank) and EXAMPLE in " ".join(p.cmdline()):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no worker of rank {rank}")


def test_worker_sigkill_resumes_from_memory_and_leaves_no_shared_memory(
    tmp_path: Path, agents: Callable[..., Agent], etcd_server: EtcdServer, job_id: str
) -> None:
    ckpt = tmp_path / "ckpts"
    agent = _start(agents, etcd_server.endpoint, job_id, ckpt, "--steps", "30", "--ckpt-every", "25")
    wait_until(lambda: _last_step(agent) >= 12, 180, "rank 0 to train 12 steps\n" + agent.output()[-3000:])
    (shm,) = _shm_dirs(job_id, agent)
    assert stat.S_IMODE(os.stat(shm).st_mode) == 0o700
    assert os.listdir(os.path.join(shm, "generations")), "memory generations exist"
    assert not ckpt.exists() or not os.listdir(ckpt), "no disk checkpoint yet"
    _worker(agent, 1).send_signal(signal.SIGKILL)
    assert agent.wait(240) == 0, agent.output()[-4000:]
    lines = _rank0_lines(agent)
    starts = [i for i, ln in enumerate(lines) if ln.startswith("start:")]
    assert len(starts) == 2, lines
    killed_at = max(int(m.group(1)) for ln in lines[:starts[1]] for m in [re.match(r"step (\d+) ", ln)] if m)
    m = re.search(r"resumed snap-\d+-\d+ \(saved at world 2\) tier memory step (\d+) ", lines[starts[1]])
    assert m, lines[starts[1]]
    resumed = int(m.group(1))
    assert killed_at - EVERY <= resumed <= killed_at and resumed >= 10, (killed_at, resumed)
    assert any(ln.startswith("done: steps=30 ") for ln in lines)
    # The job is over: its shared memory is gone, and so is the watchdog.
    wait_until(lambda: not os.path.exists(shm), 30, f"{shm} to be removed")
    assert not any("elasticrun-snap-" in " ".join(p.info["cmdline"] or []) and shm in " ".join(p.info["cmdline"])
                   for p in psutil.process_iter(["cmdline"]))


def test_agent_sigkill_leaves_no_shared_memory(
    tmp_path: Path, agents: Callable[..., Agent], etcd_server: EtcdServer, job_id: str
) -> None:
    agent = _start(agents, etcd_server.endpoint, job_id, tmp_path / "ckpts", "--steps", "100000", "--ckpt-every", "0")
    wait_until(lambda: _last_step(agent) >= EVERY + 1, 180, "a first snapshot\n" + agent.output()[-3000:])
    (shm,) = _shm_dirs(job_id, agent)
    assert os.listdir(os.path.join(shm, "generations"))
    agent.proc.kill()  # SIGKILL: no cleanup code of the agent runs
    agent.proc.wait(30)
    wait_until(lambda: not os.path.exists(shm), 60, f"the watchdog to remove {shm}")


def test_example_reports_a_too_small_memory_cap_once_and_trains_on(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "TORCHELASTIC_"))}
    env.update(ELASTICRUN_SNAPSHOT_DIR=str(shm), ELASTICRUN_SNAPSHOT_MEMORY="1KiB", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, EXAMPLE, "--steps", "12", "--snapshot-every", "2", "--ckpt-every", "0",
                           "--ckpt-dir", str(tmp_path / "ckpts")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if "memory snapshots" in ln]
    assert len(lines) == 1 and re.fullmatch(
        r"memory snapshots disabled: memory snapshots need [\d.]+ KiB \(3 generations of [\d.]+ KiB\) but "
        r"ELASTICRUN_SNAPSHOT_MEMORY caps them at 1\.0 KiB: raise the cap or snapshot less state", lines[0]), lines
    assert "done: steps=12 " in proc.stdout
    assert not (shm / "generations").exists() or not os.listdir(shm / "generations")


def test_example_async_snapshots_persist_to_disk_and_resume_from_memory(tmp_path: Path) -> None:
    shm, ckpt = tmp_path / "shm", tmp_path / "ckpts"
    shm.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "TORCHELASTIC_"))}
    env.update(ELASTICRUN_SNAPSHOT_DIR=str(shm), OMP_NUM_THREADS="1")

    def run(steps: int) -> str:
        proc = subprocess.run([sys.executable, EXAMPLE, "--steps", str(steps), "--snapshot-every", "3",
                               "--persist-every", "2", "--async-snapshots", "--ckpt-every", "0", "--ckpt-dir",
                               str(ckpt)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout

    run(12)
    names = sorted(p.name for p in ckpt.iterdir())
    assert "step-00000012" in names, names  # the final save
    assert any(n.startswith("snap-00000006-") for n in names), f"the 2nd snapshot was persisted: {names}"
    out = run(14)
    assert re.search(r"resumed snap-00000012-\d+ \(saved at world 1\) tier memory step 12 ", out), out[:2000]
    assert "done: steps=14 " in out


# -- several nodes: a scale-up, then a node SIGKILLed ---------------------------------------------


def _node(agents: Callable[..., Agent], endpoint: str, job: str, node: str, ckpt: Path) -> Agent:
    return agents(
        ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", job,
         "--node-id", node, "--heartbeat-timeout", "3", "--stability-window", "0.5", "--max-restarts", "3",
         "--no-prewarm", "--shutdown-timeout", "3", EXAMPLE, "--epochs", "1000", "--dataset-size", "512",
         "--step-sleep", "0.05", "--ckpt-dir", str(ckpt), "--steps", "100000", "--ckpt-every", "0",
         "--snapshot-every", str(EVERY), "--no-inplace"],  # the restart path: every rank resumes from memory
        name=node,
    )


def _steps(agent: Agent) -> List[tuple]:
    """``[(step, world)]`` of rank 0's step lines."""
    return [(int(m.group(1)), int(m.group(2))) for ln in _rank0_lines(agent)
            for m in [re.match(r"step (\d+) .* world (\d+)$", ln.strip())] if m]


def _resumes(agent: Agent) -> List[tuple]:
    """``(tier, step, saved world)`` of every start line of rank 0 after the first."""
    out = []
    for ln in _rank0_lines(agent):
        m = re.search(r"resumed snap-\d+-\d+ \(saved at world (\d+)\) tier (\w+) step (\d+) ", ln)
        if ln.startswith("start:"):
            out.append((m.group(2), int(m.group(3)), int(m.group(1))) if m else ("nothing", 0, 0))
    return out[1:]


def _replicas(shm: str) -> List[str]:
    root = os.path.join(shm, "replicas")
    return [d for d in (os.listdir(root) if os.path.isdir(root) else [])
            if os.path.exists(os.path.join(root, d, "metadata.json"))
            and any(f.endswith(".safetensors") for f in os.listdir(os.path.join(root, d)))]


def test_scale_up_then_node_sigkill_resume_from_peer_memory(
    tmp_path: Path, agents: Callable[..., Agent], etcd_server: EtcdServer, job_id: str
) -> None:
    """A scale-up: the newcomer fetches the memory step (taken at the stop) from its peer's memory.
    A node SIGKILLed (agent and workers) at step S: the survivor resumes from its own parts plus its
    replica of the lost node's parts, at a step >= S - 2N (the newest generation whose replica had
    landed), although the newest disk checkpoint is the one of the scale-up, far older."""
    ckpt = tmp_path / "ckpts"
    a = _node(agents, etcd_server.endpoint, job_id, "A", ckpt)
    wait_until(lambda: any(s >= 2 * EVERY + 1 for s, _w in _steps(a)), 180, "node A to snapshot\n" + a.output()[-3000:])
    b = _node(agents, etcd_server.endpoint, job_id, "B", ckpt)
    # Scale-up: every rank resumes at A's memory step (B fetches the files from A's memory).
    wait_until(lambda: _resumes(a), 120, "the scale-up\n" + a.output()[-3000:] + b.output()[-3000:])
    before = max(s for s, w in _steps(a) if w == 1)
    tier, up_step, saved_world = _resumes(a)[0]
    assert (tier, saved_world) == ("memory", 1) and before - EVERY <= up_step <= before, (
        _resumes(a), before, a.output()[-5000:], b.output()[-3000:])
    (shm_a,), (shm_b,) = _shm_dirs(job_id, a), _shm_dirs(job_id, b)
    wait_until(lambda: _replicas(shm_a) and any(s >= up_step + 2 * EVERY for s, w in _steps(a) if w == 2), 120,
               "a replica of node B's parts on node A\n" + a.output()[-3000:])
    for p in b.descendants():  # the whole node: its workers, then its agent (its watchdog cleans up)
        try:
            if EXAMPLE in " ".join(p.cmdline()):
                p.kill()
        except psutil.NoSuchProcess:
            pass
    b.proc.kill()
    killed_at = max(s for s, _w in _steps(a))
    wait_until(lambda: len(_resumes(a)) >= 2, 120, "node A to resume alone\n" + a.output()[-3000:])
    tier, down_step, saved_world = _resumes(a)[1]
    assert (tier, saved_world) == ("memory", 2), _resumes(a)
    assert max(up_step + 1, killed_at - 2 * EVERY) <= down_step <= killed_at, (down_step, killed_at, up_step)
    wait_until(lambda: max(s for s, _w in _steps(a)) > down_step, 60, "node A to train on\n" + a.output()[-3000:])
    a.proc.kill()  # the job is over (its watchdog removes the shared memory)
    wait_until(lambda: not os.path.exists(shm_a) and not os.path.exists(shm_b), 60, "no shared memory left")
