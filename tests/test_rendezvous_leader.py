"""One leader watches the node records (linear watch deliveries): on the in-memory store, and on a
real etcd that the non-leaders' range watches really leave the node records out."""

from __future__ import annotations

import json
import threading
import time
from typing import Dict, List

import pytest

from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous import protocol
from elasticrun.rendezvous.protocol import Rendezvous
from elasticrun.rendezvous.records import NodeInfo, RescaleType, Topology
from elasticrun.rendezvous.view import JobView
from elasticrun.store.client import EtcdStore

from helpers.fake_store import FakeStore
from helpers.procs import wait_until
from helpers.rdzv import join, next_rounds, seen, settings

pytestmark = pytest.mark.integration  # starts etcd or processes


def leaders(nodes: List[Rendezvous]) -> List[str]:
    return [r.node_id for r in nodes if r.view.mirrors_nodes]


def test_one_leader_mirrors_the_nodes_and_the_others_do_not(store: FakeStore, cleanup):
    nodes = [join(store, n, max_nodes=4) for n in "abcd"]
    cleanup += nodes
    rounds = next_rounds(nodes)
    assert {t.round for t in rounds.values()} == {0} and len(rounds["a"].members) == 4
    assert len(leaders(nodes)) == 1, "exactly one agent watches the node records"
    for r in nodes:
        if not r.view.mirrors_nodes:
            assert r.view.nodes() == {}, f"{r.node_id} mirrors no node record"
            assert r.view.topology()[0] == rounds["a"], "but sees the round"


def test_the_leaders_death_is_noticed_and_ends_the_round(store: FakeStore, cleanup):
    nodes = {n: join(store, n) for n in "abc"}
    first = next_rounds(list(nodes.values()))["a"]
    (lead,) = leaders(list(nodes.values()))
    dead = nodes.pop(lead)
    dead.lease.stop()
    store.expire(dead.lease.lease_id)  # the leader's agent died: its node record and the leader key go
    cleanup += nodes.values()
    survivor = next(iter(nodes.values()))
    assert seen(survivor, lambda: survivor.round_change(first), 10) == f"node {lead} left or lost its lease"
    second = next_rounds(list(nodes.values()))[survivor.node_id]
    assert sorted(second.node_ids) == sorted(nodes) and second.round == 1
    assert survivor.rescale_event(1).type is RescaleType.SCALE_DOWN
    assert len(leaders(list(nodes.values()))) == 1, "a survivor took the lead"


def test_a_spare_that_leads_ends_the_round_when_a_member_dies(store: FakeStore, cleanup):
    late = NodeInfo(node_id="s", host="h", addr="127.0.0.1", nproc=1, pid=1, registered_at=time.time() + 100)
    spare = Rendezvous(store, settings(max_nodes=2), late, lambda: 29500)
    spare.ensure_config({"nnodes": "1:3", "entrypoint": "train.py"})
    spare.register()
    assert spare.leading(), "the first to claim the key leads"
    a, b = join(store, "a", max_nodes=2), join(store, "b", max_nodes=2)
    cleanup += [spare, a]
    got: Dict[str, Topology] = {}
    errors: List[BaseException] = []

    def wait_spare() -> None:
        try:
            got["first"] = spare.next_round()  # leads round 0 (without itself: it joined last), then waits
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    for r in (a, b):
        threading.Thread(target=lambda r=r: got.setdefault(r.node_id, r.next_round()), daemon=True).start()
    keys = JobKeys(a.settings.job_id)
    for n in "ab":  # both wait for round 0 before the leader looks: it joined last, so it is the spare
        wait_until(lambda n=n: (store.get_json(keys.node(n)) or {}).get("waiting_for") == 0, 10, f"{n} waiting")
    waiting = threading.Thread(target=wait_spare, daemon=True)
    waiting.start()
    wait_until(lambda: "a" in got and "b" in got, 20, "a and b in round 0")
    first = got.pop("a")
    assert got.pop("b") == first and first.node_ids == ["a", "b"], "the leader formed the round it is a spare of"
    b.lease.stop()
    store.expire(b.lease.lease_id)
    assert seen(a, lambda: a.round_change(first), 10) == "node b left or lost its lease", "the spare ended it"
    second = next_rounds([a])["a"]
    waiting.join(10)
    assert not errors, errors
    assert sorted(second.node_ids) == ["a", "s"] and got["first"] == second
    assert a.rescale_event(1).type is RescaleType.REPLACE


def test_non_leader_views_get_no_node_events_from_etcd(etcd: EtcdStore, job_id: str):
    keys = JobKeys(job_id)
    delivered: List[str] = []
    real = JobView._on_events

    class Counting(JobView):
        def _on_events(self, events, gen):  # type: ignore[no-untyped-def]
            delivered.extend(ev.key for ev in events)
            real(self, events, gen)

    view = Counting(etcd, keys, nodes=False)
    try:
        record = json.dumps(NodeInfo(node_id="n1", host="h", addr="a", nproc=1, pid=1).to_dict())
        etcd.put(keys.node("n1"), record)
        etcd.put(keys.progress_of("n1"), "{}")
        etcd.put(keys.topology, "{}")
        etcd.put(keys.config, "{}")  # the last write: once it is seen, every earlier event was too
        wait_until(lambda: view.get(keys.config) is not None, 10, "the config key in the view")
        assert delivered == [keys.topology, keys.config], "etcd left the node and progress records out"
        assert view.nodes() == {} and view.get(keys.node("n1")) is None
        view.mirror_nodes(True)  # becoming the leader: the node records are read and watched
        assert set(view.nodes()) == {"n1"}
        etcd.delete(keys.node("n1"))
        wait_until(lambda: not view.nodes(), 10, "the deleted node record to leave the view")
    finally:
        view.close()


def test_a_follower_whose_watch_went_silent_still_takes_over_from_a_leader_that_left(
    etcd: EtcdStore, job_id: str, cleanup, monkeypatch
):
    """A watch that etcd ended without a word (pyetcd keeps such a watch, silent) must not leave a node that
    follows waiting forever for a leader that left: it checks its view against etcd and reads again."""
    monkeypatch.setattr(protocol, "VIEW_CHECK_S", 1.0)
    monkeypatch.setattr(protocol, "FOLLOWER_WAIT_S", 0.5)
    nodes = {n: join(etcd, n, job_id=job_id, max_nodes=2) for n in "ab"}
    cleanup += nodes.values()
    first = next_rounds(list(nodes.values()))["a"]
    assert first.round == 0 and sorted(first.node_ids) == ["a", "b"]
    (lead,) = leaders(list(nodes.values()))
    follower = nodes["b" if lead == "a" else "a"]
    follower.view._stop_watches()  # silent: no event and no error will come
    got: Dict[str, Topology] = {}
    waiting = threading.Thread(target=lambda: got.setdefault("next", follower.next_round()), daemon=True)
    waiting.start()
    keys = JobKeys(job_id)
    wait_until(lambda: (etcd.get_json(keys.node(follower.node_id)) or {}).get("waiting_for") == 1, 10,
               "the follower waiting for round 1")
    nodes[lead].leave()  # its lease is revoked: the leader key and its record vanish
    cleanup.remove(nodes[lead])
    waiting.join(30)
    assert "next" in got, "the follower never saw the leader leave"
    assert got["next"].round == 1 and got["next"].node_ids == [follower.node_id]
    assert follower.view.mirrors_nodes, "it leads now"


def test_a_node_is_ready_before_its_store_and_the_round_waits_for_rank_0s_port(store: FakeStore, cleanup):
    """The first c10d store imports torch (seconds): the node says it waits for the round at once,
    with port 0, and the round forms only once its group rank 0 published a real port."""
    release = threading.Event()

    def slow_store() -> int:
        release.wait(20)
        return 31000

    a = Rendezvous(store, settings(max_nodes=2), NodeInfo(node_id="a", host="h", addr="x", nproc=1, pid=1),
                   slow_store)
    a.ensure_config({"nnodes": "1:3", "entrypoint": "train.py"})
    a.register()
    b = join(store, "b", max_nodes=2)
    cleanup += [a, b]
    got: Dict[str, Topology] = {}
    threads = [threading.Thread(target=lambda r=r: got.setdefault(r.node_id, r.next_round()), daemon=True)
               for r in (a, b)]
    for t in threads:
        t.start()
    keys = JobKeys(a.settings.job_id)
    wait_until(lambda: (store.get_json(keys.node("a")) or {}).get("waiting_for") == 0, 10, "a ready without a port")
    wait_until(lambda: (store.get_json(keys.node("b")) or {}).get("waiting_for") == 0, 10, "b ready")
    assert store.get_json(keys.node("a"))["store_port"] == 0
    time.sleep(0.3)  # a stability window (0.05 s) and more: still no round without rank 0's port
    assert store.get(keys.topology) is None, "no round while its group rank 0 has no store"
    release.set()
    for t in threads:
        t.join(20)
    assert got["a"] == got["b"] and got["a"].master_port == 31000 and got["a"].node_ids == ["a", "b"]
