"""etcd's runtime reconfiguration through elasticrun's client (store/members.py) on real etcd processes:
a learner added, started with the cluster's state and promoted; a member removed; the client moved to the
new members (store/client.py set_endpoints) keeps its calls, leases and watches through a member's death."""

from __future__ import annotations

import os
import threading
import time
from typing import Iterator, List

import pytest

from elasticrun.store import members as etcd
from elasticrun.store.client import EtcdStore, connect
from elasticrun.store.server import EtcdServer

from helpers.procs import wait_until

pytestmark = pytest.mark.integration


def _tail(server: EtcdServer, chars: int = 1500) -> str:
    """The end of ``server``'s log (what a failed wait shows)."""
    with open(server.log_path or os.devnull, errors="replace") as log:
        return log.read()[-chars:]


def _grow(store: EtcdStore, name: str, started: List[EtcdServer]) -> EtcdServer:
    """Add a member the safe way: learner, start with the cluster's state, promote once caught up."""
    server = EtcdServer(name=name, unsafe_no_fsync=True, joins=True)
    new, listed = etcd.add_learner(store, server.peer_url)
    assert new.learner and not new.started and new.member_id in [m.member_id for m in listed]
    server.initial_cluster = etcd.initial_cluster(listed, new.member_id, name)
    started.append(server)
    server.start(wait_healthy=False)
    deadline = time.monotonic() + 60
    while True:
        try:
            etcd.promote(store, new.member_id)
            break
        except etcd.LearnerNotReady:
            assert server.proc is not None and server.proc.poll() is None, f"the learner exited: {server.exit_reason()}"
            assert time.monotonic() < deadline, f"the learner never caught up; its log ends: {_tail(server)}"
            time.sleep(0.05)
    server.wait_healthy(30)
    return server


@pytest.fixture
def servers() -> Iterator[List[EtcdServer]]:
    """Every etcd member a test starts (the first one started already), stopped at the end."""
    started = [EtcdServer(name="first", unsafe_no_fsync=True).start()]
    yield started
    for s in started:
        s.stop()


@pytest.fixture
def store(servers: List[EtcdServer]) -> Iterator[EtcdStore]:
    """A client of the first member."""
    client = connect(servers[0].endpoint, retry_timeout=20)
    yield client
    client.close()


def test_a_single_member_grows_to_three_and_loses_one(servers: List[EtcdServer], store: EtcdStore) -> None:
    first = servers[0]
    for name in ("second", "third"):
        _grow(store, name, servers)
    listed = etcd.list_members(store)
    assert sorted(m.name for m in listed) == ["first", "second", "third"]
    assert all(m.voter and m.started and m.client_urls for m in listed)
    assert etcd.leader_id(store) in {m.member_id for m in listed}

    store.set_endpoints(",".join(etcd.endpoint_of(m.client_urls[0]) for m in listed))
    lease = store.grant_lease(10)
    store.put("/t/a", "1", lease=lease)
    seen: List[str] = []
    ended = threading.Event()

    def watch() -> None:
        store.watch_prefix("/t/", lambda evs: seen.extend(e.key for e in evs), lambda _err: ended.set())

    watch()
    first.kill()  # SIGKILL: the member the client started on (and maybe raft's leader)
    store.put("/t/b", "2")  # the call fails over to a live member
    assert store.refresh_lease(lease) > 0, "the lease outlives the member's death"
    gone = [m for m in listed if m.name == "first"][0]
    assert {m.name for m in etcd.remove(store, gone.member_id)} == {"second", "third"}
    with pytest.raises(etcd.MembershipRefused, match="member not found"):
        etcd.remove(store, gone.member_id)
    survivors = etcd.list_members(store)
    store.set_endpoints(",".join(etcd.endpoint_of(m.client_urls[0]) for m in survivors))
    wait_until(lambda: "/t/b" in seen or ended.is_set(), 30, "the watch to deliver /t/b or to end")
    if ended.is_set():  # it was on the dead member: it ended, and its owner watches again (as JobView does)
        watch()
    store.put("/t/c", "3")
    wait_until(lambda: "/t/c" in seen, 30, "the watch to deliver a change made after the member died")
    assert store.get("/t/a") is not None  # the leased key survived


def test_the_last_member_is_never_removed_and_a_second_learner_is_refused(store: EtcdStore) -> None:
    [me] = etcd.list_members(store)
    with pytest.raises(etcd.MembershipRefused, match="not enough started members"):
        etcd.remove(store, me.member_id)
    first, _ = etcd.add_learner(store, "http://127.0.0.1:1")  # never started: costs no quorum
    with pytest.raises(etcd.MembershipRefused, match="learner"):
        etcd.add_learner(store, "http://127.0.0.1:2")
    with pytest.raises(etcd.LearnerNotReady):
        etcd.promote(store, first.member_id)
    store.put("/t/x", "1")  # a learner that never started leaves the cluster writable
    etcd.remove(store, first.member_id)
    assert [m.name for m in etcd.list_members(store)] == ["first"]


def test_a_removed_member_stops_by_itself(servers: List[EtcdServer], store: EtcdStore) -> None:
    second = _grow(store, "second", servers)
    member = [m for m in etcd.list_members(store) if m.name == "second"][0]
    etcd.remove(store, member.member_id)
    wait_until(lambda: not second.running(), 30, "the removed member's process to exit")
    assert [m.name for m in etcd.list_members(store)] == ["first"]
