"""Ending a broken round's groups from a watch thread (elasticrun/train/abort.py) with real gloo groups.

Real processes and real torch.distributed (gloo; NCCL needs GPUs: tests marked ``gpu`` cover it):
rank 1 blocks in an all-reduce that rank 0 never joins while rank 0 keeps its connections open, the
way a survivor waits on another survivor. Nothing but the watch's abort on the agent's word can end
it before the group's 60 s timeout; after it the groups are destroyed and a new world forms."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch.distributed as dist

from elasticrun.job import env as names
from elasticrun.store.server import free_port
from tests.helpers.procs import REPO, SCRIPTS, wait_until, worker_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_the_watch_ends_a_blocked_collective_and_a_new_world_forms(tmp_path) -> None:
    word, out = tmp_path / "word", tmp_path / "out.json"
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    nxt = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "round_abort_worker.py")], env=worker_env({
        names.RANK: str(r), names.WORLD_SIZE: "2", names.MASTER_ADDR: "127.0.0.1", names.MASTER_PORT: str(store.port),
        "NEXT_PORT": str(nxt.port), names.USE_AGENT_STORE: "True", "ABORT_WORD": str(word),
        "ABORT_OUT": str(out), "PYTHONPATH": str(REPO)})) for r in (0, 1)]
    try:
        wait_until(lambda: (tmp_path / "out.json.blocked").exists(), 60, "rank 1 entering its all-reduce")
        assert all(p.poll() is None for p in procs) and not out.exists(), "blocked: nothing ends it by itself"
        word.touch()  # the agent's word that the round broke
        for p in procs:
            assert p.wait(timeout=60) == 0
        row = json.loads(out.read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert row["fired"] and row["raised"] is not None, row
    assert row["after_word_s"] < 20, f"ended {row['after_word_s']:.1f} s after the word (the timeout is 60 s)"
    assert row["world_size_after_abort"] == 2, "the aborted groups stay registered until destroyed"
    assert row["new_world_sum"] == 2.0, "the next world formed after the aborted one was destroyed"
