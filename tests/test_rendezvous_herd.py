"""What N agents doing the same thing at once cost etcd and each other (thousands of nodes starting).

- The job's settings: every node but the first finds them in one read, and writes nothing.
- The leader key: an agent whose view does not show a leader reads before it creates (a failed
  create is a raft entry; N agents at once made N of them), and trusts that read until its view
  has caught up with it (a view seconds behind cost a read per loop turn).
- The round's c10d store: an agent whose store was up at once wakes nobody (agents sharing a view,
  as in the bench, all woke for each one).
- A node waiting for a round that another node forms sleeps until something changes (no timer).
"""

from __future__ import annotations

import threading
import time
from typing import Any, List, Optional

import pytest

from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.leader import Leadership
from elasticrun.rendezvous.storehost import StoreHost

from helpers.fake_store import FakeStore
from helpers.procs import wait_until
from helpers.rdzv import JOB, join

pytestmark = pytest.mark.integration  # starts etcd or processes


class Counted(FakeStore):
    """The in-memory store, counting creates and reads."""

    def __init__(self) -> None:
        super().__init__()
        self.creates: List[str] = []
        self.reads: List[str] = []

    def create(self, key: str, value: Any, lease: Optional[int] = None) -> bool:
        self.creates.append(key)
        return super().create(key, value, lease)

    def txn(self, guards: Any, puts: Any = (), delete_prefixes: Any = (), deletes: Any = ()) -> bool:
        puts = list(puts)
        self.creates.extend(k for k, _, _ in puts)
        return super().txn(guards, puts, delete_prefixes, deletes)

    def get(self, key: str) -> Any:
        self.reads.append(key)
        return super().get(key)


class BehindView:
    """A view that has not yet received the leader key (its watch is seconds behind etcd)."""

    def __init__(self) -> None:
        self.revision = 0
        self.mirrors_nodes = False

    def get(self, key: str) -> None:
        return None

    def mirror_nodes(self, on: bool) -> None:
        self.mirrors_nodes = on


def test_only_the_first_node_writes_the_job_settings(cleanup):
    store = Counted()
    try:
        first = join(store, "a")
        cleanup.append(first)
        keys = JobKeys(JOB)
        assert store.creates.count(keys.config) == 1
        others = [join(store, n) for n in "bc"]
        cleanup += others
        assert store.creates.count(keys.config) == 1, "the others found the settings and wrote none"
    finally:
        store.close()


def test_a_leader_claim_reads_first_and_trusts_the_read_until_the_view_catches_up():
    store = Counted()
    keys = JobKeys(JOB)
    try:
        theirs, ours = store.grant_lease(10), store.grant_lease(10)
        assert store.create(keys.leader, "a", lease=theirs)
        store.creates.clear()
        view = BehindView()
        claim = Leadership(store, keys, view, "b")  # type: ignore[arg-type]
        assert not claim.claim(ours)
        assert store.creates == [], "the read showed a leader: no create (a failed write) was sent"
        reads = len(store.reads)
        for _ in range(5):  # our loop's next turns, the view still behind
            assert not claim.claim(ours)
        assert len(store.reads) == reads, "the read is trusted while the view is behind it"

        held = store.get(keys.leader)
        store.revoke_lease(theirs)  # the leader leaves; our view then catches up past its key
        view.revision = held.mod_revision + 1
        assert claim.claim(ours), "a view past the read's revision without the key: claim it"
        assert store.creates == [keys.leader] and view.mirrors_nodes
    finally:
        store.close()


def test_a_store_up_at_once_wakes_nobody_and_a_late_one_wakes_its_waiter():
    pokes: List[int] = []
    host = StoreHost(lambda: 1234, on_ready=lambda: pokes.append(1))
    host.start()
    assert host.port(5.0) == 1234
    assert pokes == [], "nobody waited for the port: nobody is woken"

    release = threading.Event()

    def slow() -> int:
        release.wait(10)
        return 4321

    host = StoreHost(slow, on_ready=lambda: pokes.append(2))
    host.start()
    assert host.port(0.0) == 0, "still starting"
    release.set()
    wait_until(lambda: pokes == [2], 5, "the waiter to be told that the store is up")
    assert host.port() == 4321


def test_a_waiting_follower_sleeps_until_something_changes(cleanup):
    """N followers waiting for a round wake when something they wait for changes, not on a timer: a
    timer costs every waiting node a turn per tick, N x the time the round takes to form (that grows
    with N). Two of three nodes joined: the round cannot form, nothing changes for 3 s."""
    store = FakeStore()
    try:
        nodes = [join(store, n, min_nodes=3, join_timeout=30.0) for n in "ab"]
        cleanup += nodes
        turns = {r.node_id: 0 for r in nodes}
        for r in nodes:
            r.on_beat = lambda _id=r.node_id: turns.__setitem__(_id, turns[_id] + 1)
        for r in nodes:
            threading.Thread(target=lambda r=r: _quietly(r.next_round), daemon=True).start()
        wait_until(lambda: sum(r.leadership.leads for r in nodes) == 1 and all(turns.values()), 10,
                   "a leader, and both nodes waiting")
        follower = next(r for r in nodes if not r.leadership.leads)
        before = turns[follower.node_id]
        time.sleep(3.0)  # the window observed: nothing changes in the job during it
        assert turns[follower.node_id] - before <= 1, (
            f"a waiting follower turned {turns[follower.node_id] - before} times in 3 s with nothing changing")
    finally:
        store.close()


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - the node leaves at the end of the test: its wait ends with an error
        pass
