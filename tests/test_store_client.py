"""The etcd client wrapper and the embedded server, against a real etcd."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from elasticrun.errors import StoreError
from elasticrun.store.client import Guard, connect, parse_endpoints
from elasticrun.store.lease import KeepAlive
from elasticrun.store.server import EtcdServer, find_etcd_binary

from helpers.procs import wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes


def test_parse_endpoints():
    assert parse_endpoints("a:1,http://b:2379/, https://c:3") == [("a", 1), ("b", 2379), ("c", 3)]
    assert parse_endpoints("hostonly") == [("hostonly", 2379)]
    for bad in ("", "a:b", "a:0", ":12"):
        with pytest.raises(StoreError):
            parse_endpoints(bad)


def test_kv_cas_and_json(etcd, job_id):
    key = f"/test/{job_id}/k"
    assert etcd.get(key) is None
    assert etcd.create(key, "1") and not etcd.create(key, "2")
    kv = etcd.get(key)
    assert kv.value == b"1"
    assert etcd.cas(key, "3", kv.mod_revision)
    assert not etcd.cas(key, "4", kv.mod_revision), "a stale revision must lose"
    etcd.put_json(key, {"a": [1, 2]})
    assert etcd.get_json(key) == {"a": [1, 2]}
    kvs, rev = etcd.get_prefix(f"/test/{job_id}/")
    assert [k.key for k in kvs] == [key] and rev >= kv.mod_revision
    assert etcd.txn_delete_prefix_if(f"/test/{job_id}/", guard=(key, etcd.get(key).mod_revision))
    assert etcd.get(key) is None


def test_concurrent_cas_has_one_winner(etcd, job_id):
    key = f"/test/{job_id}/round"
    wins = []

    def contend(i: int) -> None:
        if etcd.cas(key, str(i), 0):
            wins.append(i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert etcd.get(key).value == str(wins[0]).encode()


def test_watch_sees_puts_and_deletes(etcd, job_id):
    prefix = f"/test/{job_id}/"
    seen = []
    cancel = etcd.watch_prefix(prefix, seen.extend, lambda err: None)
    try:
        etcd.put(prefix + "a", "x")
        etcd.delete(prefix + "a")
        wait_until(lambda: len(seen) >= 2, 5, "two watch events")
        assert [(e.key, e.deleted) for e in seen[:2]] == [(prefix + "a", False), (prefix + "a", True)]
    finally:
        cancel()


def test_lease_keepalive_and_expiry(etcd, job_id):
    key = f"/test/{job_id}/node"
    lost = []
    ka = KeepAlive(etcd, 2, on_lost=lost.append)
    etcd.put(key, "alive", lease=ka.lease_id)
    time.sleep(3.0)  # longer than the TTL: only the keep-alive can keep the key (the thing under test)
    assert etcd.get(key) is not None and ka.valid() and not lost
    ka.stop()  # stop refreshing: etcd expires the lease, the watch-able key goes away
    wait_until(lambda: etcd.get(key) is None, 6, "the key to expire with its lease")
    ka2 = KeepAlive(etcd, 2)
    etcd.put(key, "x", lease=ka2.lease_id)
    ka2.revoke()
    assert etcd.get(key) is None, "revoke removes the keys at once"


def test_a_lease_counts_as_confirmed_when_its_grant_was_sent(etcd, monkeypatch):
    """etcd counts the TTL from its grant; an answer that reaches a busy process late must not move the
    local deadline later than etcd's (fencing), and the first keep-alive is then due at once."""
    real_grant = etcd.grant_lease

    def late_answer(ttl: int) -> int:
        lease_id = real_grant(ttl)
        time.sleep(1.5)  # the answer waits for this process (a starved thread, a paused VM)
        return lease_id

    monkeypatch.setattr(etcd, "grant_lease", late_answer)
    sent = time.monotonic()
    ka = KeepAlive(etcd, 30)  # first keep-alive 5-10 s after the grant: none has confirmed it yet below
    try:
        assert ka.unconfirmed_for() >= 1.5, "confirmed as of the grant, not of its late answer"
        assert sent + ka.interval / 2 <= ka.next_due <= sent + ka.interval, "first keep-alive counted from the grant"
        assert ka.valid()
    finally:
        ka.revoke()


def test_unreachable_etcd_is_one_clear_error():
    with pytest.raises(StoreError) as err:
        connect("127.0.0.1:1", retry_timeout=0.5)
    assert "cannot reach etcd at 127.0.0.1:1" in str(err.value)
    assert "elasticrun etcd" in str(err.value)


def test_restart_keeps_data_and_client_recovers(tmp_path):
    server = EtcdServer(data_dir=str(tmp_path / "data")).start()
    try:
        store = connect(server.endpoint)
        store.put("/test/restart", "kept")
        server.kill()
        server.restart()
        assert store.get("/test/restart").value == b"kept"
        store.close()
    finally:
        server.stop()


def test_binary_lookup_order(tmp_path, monkeypatch):
    fake = tmp_path / "etcd"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert find_etcd_binary(str(fake), "ELASTICRUN_ETCD_BINARY") == str(fake)
    monkeypatch.setenv("ELASTICRUN_ETCD_BINARY", str(tmp_path / "missing"))
    with pytest.raises(StoreError, match="ELASTICRUN_ETCD_BINARY"):
        find_etcd_binary(None, "ELASTICRUN_ETCD_BINARY")
    assert find_etcd_binary().endswith("etcd"), "only the variable the caller names is read"
    monkeypatch.delenv("ELASTICRUN_ETCD_BINARY")
    assert find_etcd_binary(None, "ELASTICRUN_ETCD_BINARY").endswith("etcd")


def test_a_late_time_out_fails_the_member_it_went_to_and_failover_avoids_the_newest_failure() -> None:
    """No etcd needed (gRPC channels connect lazily): a call that timed out on member a, sent before the
    client moved to b, marks a failed — not b; and with b failing too, the client goes to c (never
    failed), not back to a (pyetcd takes the first member not failed right now: a, half a second on)."""
    from pyetcd.exceptions import ConnectionTimeoutError

    from elasticrun.store.connection import client_args, new_client

    hosts = [("127.0.0.1", 1), ("127.0.0.1", 2), ("127.0.0.1", 3)]
    client = new_client(client_args("x", hosts, 1.0, None, None, None, None), None, None)
    a, b, c = (f"127.0.0.1:{p}" for p in (1, 2, 3))

    class Late(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.DEADLINE_EXCEEDED

    try:
        client._current_endpoint_label = a
        client.call(lambda _c: None)  # a call goes to a ...
        client.endpoints[a].fail()
        client.endpoints[a].last_failed -= 1.0  # ... a keep-alive failed over from it a second ago
        client._current_endpoint_label = b
        with pytest.raises(ConnectionTimeoutError):
            try:
                raise Late()
            except Late as err:
                client._manage_grpc_errors(err)  # ... and the call's deadline runs out now
        assert client.endpoints[a].is_failed() and not client.endpoints[b].is_failed()
        client.endpoints[a].last_failed -= 1.0  # a's failure is past its retry time
        client.call(lambda _c: None)
        client.endpoints[b].fail()
        client.channel  # noqa: B018 - the property picks the member
        assert client._current_endpoint_label == c
    finally:
        client.close()


def test_keepalives_of_many_leases_go_over_streams_side_by_side(etcd, monkeypatch):
    from elasticrun.store import connection

    monkeypatch.setattr(connection, "KEEPALIVE_STREAM_LEASES", 16)
    monkeypatch.setattr(connection, "KEEPALIVE_STREAMS_MAX", 4)
    streams = []
    stub = etcd._client.leasestub
    real = stub.LeaseKeepAlive
    monkeypatch.setattr(stub, "LeaseKeepAlive", lambda reqs, *a, **kw: streams.append(1) or real(reqs, *a, **kw))
    leases = [etcd.grant_lease(30) for _ in range(100)]
    etcd.revoke_lease(leases[37])
    answers = etcd.refresh_leases(leases, timeout=5)
    assert len(streams) == 4, "100 leases: 4 streams of 25 (at most 4 streams, at least 16 leases each)"
    assert sorted(answers) == sorted(leases), "every lease answered"
    assert answers[leases[37]] <= 0 and all(answers[i] > 0 for i in leases if i != leases[37])
    for i in leases:
        etcd.revoke_lease(i)


def test_a_snapshot_past_its_deadline_leaves_etcd_running(tmp_path):
    """etcd before 3.5.5 panics when a read-only Txn's deadline passes while it is applied; snapshots are
    Range requests, which just fail. Reads of 8 MB with a 2 ms deadline: every one is late."""
    server = EtcdServer(data_dir=str(tmp_path / "data")).start()
    try:
        full = connect(server.endpoint)
        for i in range(8):
            full.put(f"/big/{i}", "x" * 1_000_000)
        hurried = connect(server.endpoint, check=False, timeout=0.002, retry_timeout=0.05)
        for _ in range(10):
            try:
                hurried.snapshot([f"/big/{i}" for i in range(8)], ["/big/"])
            except StoreError:
                pass  # late: that is the point
            assert server.proc.poll() is None, open(server.log_path).read()[:500]
        snap = full.snapshot(["/big/0", "/absent"], ["/big/", "/none/"])
        assert snap.kvs["/absent"] is None and len(snap.kvs["/big/0"].value) == 1_000_000
        assert snap.counts == {"/big/": 8, "/none/": 0} and snap.revision == full.get("/big/7").mod_revision
        hurried.close()
        full.close()
    finally:
        server.stop()


def test_a_compare_only_txn_judges_its_guards(etcd, job_id):
    key, free = f"/test/{job_id}/g", f"/test/{job_id}/free/"
    etcd.put(key, "v")
    rev = etcd.get(key).mod_revision
    assert etcd.txn([Guard(key, rev), Guard.absent(f"/test/{job_id}/none"), Guard.empty(free)])
    assert not etcd.txn([Guard(key, rev + 1)]) and not etcd.txn([Guard.absent(key)])
    etcd.put(free + "x", "1")
    assert not etcd.txn([Guard.empty(free)])


def test_closing_a_store_while_another_thread_makes_watches_ends_that_thread_with_one_error(etcd_server, job_id):
    """A thread still at work (a view re-making its watches) when the store closes must not reach a closed
    gRPC channel: making a call on one crashed the process (a segfault in grpc). close() waits for the call
    under way; the next one raises StoreError."""
    store = connect(etcd_server.endpoint)
    made, errors = [0], []

    def churn() -> None:
        while True:
            try:
                cancel = store.watch_prefix(f"/test/{job_id}/", lambda events: None, lambda err: None)
                cancel()
                made[0] += 1
            except StoreError as err:
                errors.append(str(err))
                return

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    wait_until(lambda: made[0] >= 20, 30, "watches made and cancelled in a loop")
    store.close()
    closed = time.monotonic()
    thread.join(15)
    assert not thread.is_alive() and time.monotonic() - closed < 5, "no retries against a closed client"
    assert errors == [f"the etcd client for {etcd_server.endpoint} is closed"], errors
    began = time.monotonic()
    with pytest.raises(StoreError, match="is closed"):
        store.get(f"/test/{job_id}/k")
    assert time.monotonic() - began < 1
