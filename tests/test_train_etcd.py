"""CheckpointRequests and ProgressReporter against a real etcd server (one process, world 1)."""

from __future__ import annotations

import json
import logging
import time
import uuid

import pytest

from elasticrun.store.client import EtcdStore
from elasticrun.store.server import EtcdServer, free_port
from elasticrun.train import CheckpointRequests, ElasticState, ProgressReporter

from helpers.procs import wait_until as wait_for

pytestmark = pytest.mark.integration  # starts etcd or processes


@pytest.fixture
def server(etcd_server: EtcdServer) -> EtcdServer:
    """The session's real etcd (conftest)."""
    return etcd_server


@pytest.fixture
def store(etcd: EtcdStore) -> EtcdStore:
    """A client of the session's etcd (conftest)."""
    return etcd


def state(endpoint: str, job: str, **kw) -> ElasticState:
    return ElasticState(rdzv_endpoint=endpoint, rdzv_id=job, node_id="node-a@h:1", launched=True, elastic=True, **kw)


def request(store: EtcdStore, job: str, rid: str, at: float) -> None:
    store.put_json(f"/elasticrun/{job}/control/checkpoint/{rid}", {"request_id": rid, "requested_at": at})


def poll_until_ids(req: CheckpointRequests, timeout: float = 10.0):
    step = [0]

    def attempt():
        step[0] += 1
        return req.poll(step[0]).request_ids

    return wait_for(attempt, timeout, "a checkpoint request to reach the loop")


def test_requests_flow(server: EtcdServer, store: EtcdStore):
    job = f"job-{uuid.uuid4().hex[:8]}"
    # one request answered by an earlier round, one still waiting from before this round started
    request(store, job, "old-done", 1.0)
    store.put_json(f"/elasticrun/{job}/control/checkpoint-done/old-done", {"name": "x", "root": "/r", "step": 1})
    request(store, job, "early", 2.0)
    req = CheckpointRequests(state(server.endpoint, job), every=1)
    try:
        assert poll_until_ids(req) == ("early",), "a pending request from before the start is picked up"
        assert req.poll(100).request_ids == (), "handed to the loop once"
        req.done("early", "step-00000100", "/ckpts", 100)
        done = wait_for(lambda: store.get_json(f"/elasticrun/{job}/control/checkpoint-done/early"), 10, "answer")
        assert done == {"name": "step-00000100", "root": "/ckpts", "step": 100}

        # requests written while running arrive through the watch; oldest first
        request(store, job, "r2", 20.0)
        request(store, job, "r1", 10.0)
        wait_for(lambda: len(req.local_pending()) == 2, 10, "both requests")
        assert req.poll(200).request_ids == ("r1", "r2")
        req.fail("r1", "disk full")
        req.done("r2", "step-00000200", "/ckpts", 200)

        # a request withdrawn (key deleted) before the loop saw it is dropped
        request(store, job, "gone", 30.0)
        wait_for(lambda: "gone" in req.local_pending(), 10, "request 'gone'")
        store.delete(f"/elasticrun/{job}/control/checkpoint/gone")
        wait_for(lambda: "gone" not in req.local_pending(), 10, "withdrawal")
    finally:
        req.close()
    base = f"/elasticrun/{job}/control/checkpoint-done/"
    assert store.get_json(base + "r1") == {"error": "disk full"}, "close() flushes queued answers"
    assert store.get_json(base + "r2")["step"] == 200
    assert store.get(base + "gone") is None
    # Answered requests are deleted (etcd keeps no checkpoint traffic), a leftover of an earlier
    # round too; the answers live on a lease, so one nobody reads expires.
    requests, _ = store.get_prefix(f"/elasticrun/{job}/control/checkpoint/")
    assert [kv.key.rsplit("/", 1)[-1] for kv in requests] == [], requests
    for rid in ("early", "r1", "r2"):
        assert store.get(base + rid).lease != 0, rid


def test_requests_only_on_rank0_and_noop_without_endpoint(server: EtcdServer, store: EtcdStore):
    job = f"job-{uuid.uuid4().hex[:8]}"
    request(store, job, "r", 1.0)
    other = CheckpointRequests(state(server.endpoint, job, rank=1, world_size=2), every=1)
    assert other._thread is None
    other.done("r", "n", "/r", 1)  # no-op on rank 1
    other.close()
    off = CheckpointRequests(state("", job), every=1)
    d = off.poll(0, stop=True)
    assert d.stop and d.checkpoint and d.request_ids == ()
    off.close()
    assert store.get(f"/elasticrun/{job}/control/checkpoint-done/r") is None


def test_progress_is_throttled_and_lease_attached(server: EtcdServer, store: EtcdStore):
    job = f"job-{uuid.uuid4().hex[:8]}"
    rep = ProgressReporter(state(server.endpoint, job), interval=1.0, ttl=2)
    key = f"/elasticrun/{job}/progress/node-a@h:1"
    t0 = time.monotonic()
    try:
        step = 0
        while time.monotonic() - t0 < 1.5:
            step += 1
            rep.report(step, 0.5, samples=step * 64)
            time.sleep(0.005)
        kv = wait_for(lambda: store.get(key), 5, "progress key")
        assert kv.lease != 0, "progress is attached to a lease"
        assert rep.puts <= 3, f"{rep.puts} puts in 1.5 s: not throttled to 1/s"
        wait_for(lambda: store.get_json(key)["step"] > 1, 5, "a later report")
        value = store.get_json(key)
        assert value["loss"] == 0.5 and value["rank"] == 0 and value["samples_per_s"] > 0
        assert abs(value["time"] - time.time()) < 5
    finally:
        rep.close()
    assert store.get_json(key)["step"] == step, "close() writes the last report"
    wait_for(lambda: store.get(key) is None, 8, "the progress key to expire with its lease")


def test_progress_only_from_local_rank0(server: EtcdServer):
    rep = ProgressReporter(state(server.endpoint, "j", rank=3, local_rank=1, world_size=4))
    assert not rep.active and rep._thread is None
    rep.report(1, 0.1)
    rep.close()


def test_unreachable_etcd_never_disturbs_training(caplog):
    dead = f"127.0.0.1:{free_port()}"
    caplog.set_level(logging.WARNING)
    req = CheckpointRequests(state(dead, "j"), every=1)
    rep = ProgressReporter(state(dead, "j"), interval=0.2)
    t0 = time.monotonic()
    for step in range(200):
        assert req.poll(step).request_ids == ()
        rep.report(step, 1.0)
    assert time.monotonic() - t0 < 1.0, "poll/report must not block on etcd"
    wait_for(lambda: "etcd is unreachable" in caplog.text, 15, "the warning")
    req.done("x", "n", "/r", 1)
    t1 = time.monotonic()
    req.close(timeout=3)
    rep.close(timeout=3)
    assert time.monotonic() - t1 < 7
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) <= 2, "one warning per component, not one per attempt: " + json.dumps(
        [r.getMessage() for r in warnings])
