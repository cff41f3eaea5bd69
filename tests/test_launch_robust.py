"""Agent robustness: a big order to a pre-warmed worker never blocks the agent; nan/inf durations
are one clear error."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
from pathlib import Path

import pytest

from elasticrun.launch.config import LaunchConfig, RendezvousConfig, WorkersConfig
from elasticrun.launch.workers import WorkerGroup

from helpers.launch import assert_one_line_error, run_cli
from helpers.procs import SCRIPTS, wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

TERM_SAVER = str(SCRIPTS / "term_saver.py")


def test_big_argv_to_a_stalled_warm_worker_does_not_block(tmp_path: Path) -> None:
    big = [f"{i:04d}" + "x" * 4092 for i in range(50)]  # 200 KiB of arguments (each well below MAX_ARG_STRLEN)
    cfg = LaunchConfig(rendezvous=RendezvousConfig(standalone=True),
                       workers=WorkersConfig(entrypoint=TERM_SAVER, args=[str(tmp_path), *big], nproc_per_node=1))
    group = WorkerGroup(cfg, "n", str(tmp_path), None, False, on_exit=lambda: None)
    group._fork_unsafe = "this test: the spawned standby's path"  # not the fork server (test_launch_forkserver)
    group.prewarm()
    warm = group._warm[0]
    os.kill(warm.pid, signal.SIGSTOP)  # an interpreter that will not read its stdin for a while
    env = dict(os.environ, RANK="0", ARGV_OUT=str(tmp_path / "argv"), OMP_NUM_THREADS="1")
    done = threading.Event()
    spawned = []
    try:
        worker = threading.Thread(target=lambda: (spawned.append(group._spawn(env)), done.set()), daemon=True)
        worker.start()
        assert done.wait(10), "handing a 200 KiB order to a busy pre-warmed worker blocked the agent"
    finally:
        os.kill(warm.pid, signal.SIGCONT)
    proc = spawned[0]
    assert proc is warm
    assert proc.wait(60) == 0, proc.stderr.read().decode() if proc.stderr else ""
    count, digest = wait_until(lambda: (tmp_path / "argv.0").exists() and (tmp_path / "argv.0").read_text(), 10,
                               "the worker's argv digest").split()
    expected = hashlib.sha256("\0".join([str(tmp_path), *big]).encode()).hexdigest()
    assert (int(count), digest) == (len(big) + 1, expected), "the worker got a different argv"
    assert not list(tmp_path.glob("order-*")), "the order file must be removed once read"
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


@pytest.mark.parametrize("flag", ["--heartbeat-timeout", "--shutdown-timeout", "--etcd-outage-grace",
                                  "--rescale-timeout"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_durations_are_one_clear_error(flag: str, value: str) -> None:
    proc = run_cli(["--standalone", flag, value, str(SCRIPTS / "echo_worker.py")], timeout=60)
    assert_one_line_error(proc, flag, "finite")
