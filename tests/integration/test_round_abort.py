"""Ending a broken round's groups from a watch thread (elasticrun/train/abort.py) with real gloo groups.

Real processes and real torch.distributed (gloo; NCCL needs GPUs: tests marked ``gpu`` cover it):
rank 1 blocks in an all-reduce that rank 0 never joins while rank 0 keeps its connections open, the
way a survivor waits on another survivor. Nothing but the watch's abort on the agent's word can end
it before the group's 60 s timeout; after it the groups are destroyed and a new world forms."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from elasticrun.job import env as names
from elasticrun.store.server import free_port
from elasticrun.train.abort import ABANDON_S
from tests.helpers.procs import REPO, SCRIPTS, wait_until, worker_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _run_pair(tmp_path, **extra: str) -> dict:
    """Both ranks of round_abort_worker.py; the agent's word once rank 1 blocks. Rank 1's row, with
    ``exit_after_row_s``: how long rank 1 took to exit once it had written its row."""
    word, out = tmp_path / "word", tmp_path / "out.json"
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    nxt = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "round_abort_worker.py")], env=worker_env({
        names.RANK: str(r), names.WORLD_SIZE: "2", names.MASTER_ADDR: "127.0.0.1", names.MASTER_PORT: str(store.port),
        "NEXT_PORT": str(nxt.port), names.USE_AGENT_STORE: "True", "ABORT_WORD": str(word),
        "ABORT_OUT": str(out), "PYTHONPATH": str(REPO), **extra})) for r in (0, 1)]
    try:
        wait_until(lambda: (tmp_path / "out.json.blocked").exists(), 60, "rank 1 entering its all-reduce")
        assert all(p.poll() is None for p in procs) and not out.exists(), "blocked: nothing ends it by itself"
        word.touch()  # the agent's word that the round broke
        wait_until(lambda: out.exists() or procs[1].poll() is not None, 60, "rank 1's row")
        assert procs[1].wait(timeout=60) == 0
        exited = time.time()
        assert procs[0].wait(timeout=60) == 0
        row = json.loads(out.read_text())
        row["exit_after_row_s"] = exited - out.stat().st_mtime
        return row
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_the_watch_ends_a_blocked_collective_and_a_new_world_forms(tmp_path) -> None:
    row = _run_pair(tmp_path)
    assert row["fired"] and row["raised"] is not None, row
    assert row["after_word_s"] < 20, f"ended {row['after_word_s']:.1f} s after the word (the timeout is 60 s)"
    assert row["world_size_after_abort"] == 2, "the aborted groups stay registered until destroyed"
    assert row["new_world_sum"] == 2.0, "the next world formed after the aborted one was destroyed"


def test_a_collective_the_cut_cannot_wake_is_given_up_and_the_worker_exits_at_once(tmp_path) -> None:
    """gloo can close a connection without failing the collective waiting on it (the cut then finds
    nothing): the step-boundary agreements wait through ``abort.finish``, which gives such a collective up
    ``ABANDON_S`` after the watch fired. Its group (timeout 300 s) keeps a gloo thread waiting: the worker
    must still re-form and exit at once, its destructor never joining that thread."""
    row = _run_pair(tmp_path, ABORT_MODE="stuck", GROUP_TIMEOUT_S="300")
    assert row["fired"] and row["raised"] == "DistBackendError" and "given up" in row["message"], row
    assert ABANDON_S <= row["after_word_s"] < ABANDON_S + 15, f"given up {row['after_word_s']:.1f} s after the word"
    assert row["new_world_sum"] == 2.0, "the next world formed after giving up"
    assert row["exit_after_row_s"] < 15, f"exit took {row['exit_after_row_s']:.1f} s: the stuck thread was joined"
