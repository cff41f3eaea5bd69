"""A memory-tier replica transfer that cannot end does not hold its process (elasticrun/checkpoint/memory/replicas.py).

Real processes, real gloo groups, the real ``Replicator``. A re-form destroys the process groups while a
replicator's thread may be in a transfer that its peer will never take part in (the peer's thread found the
group destroyed first): closing the old round's replicator must cut that transfer at once rather than wait
for the replica timeout, since the whole job waits for the rank that closes it (the chaos soak's hang)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch.distributed as dist

from elasticrun.job import env as names
from elasticrun.store.server import free_port
from tests.helpers.procs import REPO, SCRIPTS, wait_until, worker_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

REPLICA_TIMEOUT_S = 40  # the transfer's own timeout: what closing would wait for without the cut


def _close_row(tmp_path, mode: str) -> dict:
    out = tmp_path / "out.json"
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "replica_cut_worker.py")], env=worker_env({
        names.RANK: str(r), names.WORLD_SIZE: "2", names.MASTER_ADDR: "127.0.0.1",
        names.MASTER_PORT: str(store.port), names.USE_AGENT_STORE: "True", "REPLICA_MODE": mode,
        "REPLICA_OUT": str(out), "REPLICA_BASE": str(tmp_path / "shm"), "PYTHONPATH": str(REPO),
        names.SNAPSHOT_REPLICA_TIMEOUT: str(REPLICA_TIMEOUT_S)})) for r in (0, 1)]
    try:
        wait_until(lambda: out.exists() or procs[0].poll() is not None, 120, "rank 0's close")
        assert procs[0].wait(timeout=30) == 0
        assert procs[1].wait(timeout=30) == 0
        return json.loads(out.read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_closing_a_replicator_whose_group_a_reform_destroyed_cuts_its_transfer_at_once(tmp_path) -> None:
    row = _close_row(tmp_path, "destroyed")
    assert row["wait_ended"] is False and row["wait_s"] < 5, f"a wait on the destroyed group: {row}"
    assert row["close_s"] < 5, f"close took {row['close_s']:.1f} s: it waited for a transfer that cannot end"
    assert not row["thread_alive"], "the replicator's thread still waits in gloo"
    assert row["errors"], "the cut transfer is recorded as failed"


def test_a_transfer_still_waiting_when_close_times_out_is_cut(tmp_path) -> None:
    row = _close_row(tmp_path, "alive")
    assert 1.0 <= row["close_s"] < 6, row
    assert not row["thread_alive"] and row["errors"], row
