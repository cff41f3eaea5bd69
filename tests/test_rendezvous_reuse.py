"""Reusing a job id (elasticrun/rendezvous/reuse.py) and what an ended job leaves (rendezvous/ended.py).

The decision is a pure function; the claim runs on the in-memory store (the races are driven by
hand), and the expiry of an ended job's keys against a real etcd (leases are etcd's)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any, List

import pytest

from elasticrun.errors import ConfigError, RendezvousError
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.ended import expire, stop_if_last
from elasticrun.rendezvous.protocol import JobEnded, Rendezvous
from elasticrun.rendezvous.records import NodeInfo
from elasticrun.rendezvous.reuse import Finding, JobClaim, assess
from elasticrun.rendezvous.states import JobState
from elasticrun.store.client import EtcdStore

from helpers.fake_store import FakeStore
from helpers.procs import wait_until
from helpers.rdzv import JOB, next_rounds, settings

pytestmark = pytest.mark.integration  # starts etcd or processes

MINE = {"nnodes": "1:3", "entrypoint": "train.py", "args": ["new"]}
OLD = {"nnodes": "1:3", "entrypoint": "train.py", "args": ["old"]}
ENDED = {"state": "succeeded", "reason": "all workers exited 0", "round": 0, "time": 1.0}


@pytest.mark.parametrize("config, present, state, nodes, finding", [
    (None, False, None, 0, Finding.FREE),
    (None, False, None, 2, Finding.FREE),  # a job without settings (written by an old version): ours go in
    (MINE, True, None, 2, Finding.SAME),
    (MINE, True, None, 0, Finding.SAME),  # its nodes were lost: same settings, join it
    (OLD, True, None, 2, Finding.DIFFERENT),
    (OLD, True, None, 0, Finding.ORPHANED),
    (OLD, True, ENDED, 0, Finding.ENDED),
    (MINE, True, ENDED, 0, Finding.ENDED),  # same settings or not, an ended job is never joined
    (OLD, True, ENDED, 1, Finding.ENDING),
    (None, True, None, 0, Finding.MALFORMED),
    (None, True, None, 1, Finding.DIFFERENT),  # a malformed record with nodes: nothing to check against
    (None, False, ENDED, 0, Finding.ENDED),  # an ended job whose settings are gone
])
def test_what_a_starting_node_finds(config, present, state, nodes, finding) -> None:
    assert assess(config, present, state, nodes, MINE) is finding


def _claim(store: FakeStore, mine: Any = MINE, grace: float = 0.5, timeout: float = 5.0) -> JobClaim:
    said: List[str] = []
    claim = JobClaim(store, JobKeys(JOB), mine, timeout=timeout, grace=grace, say=said.append)
    claim.said = said  # type: ignore[attr-defined]
    return claim


def _ended_job(store: FakeStore, config: Any = OLD, state: Any = ENDED) -> JobKeys:
    keys = JobKeys(JOB)
    store.put(keys.config, json.dumps(config))
    store.put(keys.topology, json.dumps({"round": 0, "members": [], "master_addr": "a", "master_port": 1}))
    store.put(keys.event(0), json.dumps({"anything": 1}))
    if state is not None:
        store.put(keys.state, json.dumps(state))
    return keys


def test_an_ended_jobs_keys_are_removed_and_ours_written(store: FakeStore) -> None:
    keys = _ended_job(store)
    claim = _claim(store)
    head = claim.run()
    assert json.loads(head.config_kv.value) == MINE and head.state_kv is None
    kvs, _ = store.get_prefix(keys.prefix)
    assert [kv.key for kv in kvs] == [keys.config], "nothing of the old job is left"
    assert any("ended (succeeded: all workers exited 0); removed its keys" in m for m in claim.said)


def test_an_ended_job_whose_node_is_still_leaving_is_waited_for(store: FakeStore) -> None:
    keys = _ended_job(store)
    lease = store.grant_lease(10)
    store.put(keys.node("old"), "{}", lease=lease)
    claim = _claim(store)
    got: List[Any] = []
    t = threading.Thread(target=lambda: got.append(claim.run()), daemon=True)
    t.start()
    wait_until(lambda: any("waiting for its 1 node(s) to leave" in m for m in claim.said), 5, "the wait")
    assert store.get(keys.state) is not None, "nothing removed while a node of the old job is registered"
    store.revoke_lease(lease)  # the old node exits
    t.join(10)
    assert got and json.loads(got[0].config_kv.value) == MINE


def test_an_ended_job_whose_node_never_leaves_is_a_retryable_error(store: FakeStore) -> None:
    keys = _ended_job(store)
    store.put(keys.node("old"), "{}", lease=store.grant_lease(10))
    with pytest.raises(RendezvousError, match="still registered after 0s"):
        _claim(store, timeout=0.3).run()


def test_an_orphaned_job_is_taken_over_after_the_grace_unless_a_node_comes_back(store: FakeStore) -> None:
    keys = _ended_job(store, state=None)  # no end recorded, no node: its nodes were lost
    started = time.monotonic()
    head = _claim(store, grace=0.5).run()
    assert time.monotonic() - started >= 0.5, "a lost job's nodes get the grace to come back"
    assert json.loads(head.config_kv.value) == MINE

    store.put(keys.config, json.dumps(OLD))
    claim = _claim(store, grace=5.0)
    errors: List[BaseException] = []

    def run() -> None:
        try:
            claim.run()
        except BaseException as err:  # noqa: BLE001 - checked below
            errors.append(err)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_until(lambda: claim.said, 5, "the grace to start")
    store.put(keys.node("back"), "{}", lease=store.grant_lease(10))  # one of its nodes came back
    t.join(10)
    assert errors and isinstance(errors[0], ConfigError) and "different settings" in str(errors[0])


def test_a_malformed_settings_record_is_replaced_when_no_node_runs(store: FakeStore) -> None:
    keys = JobKeys(JOB)
    store.put(keys.config, b"[1, 2")
    assert json.loads(_claim(store).run().config_kv.value) == MINE
    store.put(keys.config, b"[1, 2")
    store.put(keys.node("n"), "{}", lease=store.grant_lease(10))
    with pytest.raises(ConfigError, match="malformed settings record"):
        _claim(store).run()


class ReplacedBeforeRegister(FakeStore):
    """An in-memory store where, between a node's check of the job and its registration, the job ends
    and a node of another job with other settings takes the id (a scheduler restarting a job at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def txn(self, guards: Any, puts: Any = (), delete_prefixes: Any = (), deletes: Any = ()) -> bool:
        puts = list(puts)
        keys = JobKeys(JOB)
        if self.armed and any(k == keys.node("b") for k, _, _ in puts):
            self.armed = False
            super().txn([], [(keys.config, json.dumps(OLD), None),
                             (keys.node("other"), "{}", self.grant_lease(10))], [keys.prefix])
        return super().txn(guards, puts, delete_prefixes, deletes)


def test_a_job_replaced_between_the_check_and_the_registration_is_checked_again() -> None:
    store = ReplacedBeforeRegister()
    try:
        b = Rendezvous(store, settings(), NodeInfo(node_id="b", host="h", addr="a", nproc=1, pid=1), lambda: 1)
        b.ensure_config(MINE)
        store.armed = True
        with pytest.raises(ConfigError, match="different settings"):
            b.register()  # old code: registered into the other job, with other settings
        assert store.get(JobKeys(JOB).node("b")) is None and b.lease is None
    finally:
        store.close()


def test_the_last_node_to_leave_marks_the_job_stopped_and_a_new_job_takes_the_id(store: FakeStore) -> None:
    def node(name: str, config: Any) -> Rendezvous:
        r = Rendezvous(store, settings(), NodeInfo(node_id=name, host="h", addr="a", nproc=1, pid=1), lambda: 1)
        r.ensure_config(config)
        r.register()
        return r

    a, b = node("a", OLD), node("b", OLD)
    next_rounds([a, b])
    keys = JobKeys(JOB)
    a.leaving("received SIGTERM", 143)
    a.leave()
    assert store.get(keys.state) is None, "b still runs the job"
    b.leaving("received SIGTERM", 143)
    b.leave()
    state = json.loads(store.get(keys.state).value)
    assert state["state"] == JobState.STOPPED and state["exit_code"] == 143 and "b, left (received SIGTERM)" in \
        state["reason"]
    c = node("c", MINE)  # other settings: old code refused it with a ConfigError, for good
    try:
        assert json.loads(store.get(keys.config).value) == MINE
        assert next_rounds([c])["c"].round == 0, "a new job, from its first round"
    finally:
        c.leave()


def test_a_node_that_finds_the_job_ended_as_a_spare_says_so(store: FakeStore) -> None:
    r = Rendezvous(store, settings(), NodeInfo(node_id="s", host="h", addr="a", nproc=1, pid=1), lambda: 1)
    r.ensure_config(MINE)
    r.register()
    try:
        store.put(JobKeys(JOB).state, json.dumps(ENDED))
        with pytest.raises(JobEnded) as ended:
            r.next_round()
        assert ended.value.spare and ended.value.succeeded
    finally:
        r.leave()


# -- an ended job's keys expire (real etcd: leases) -----------------------------------------------


def _real_ended_job(etcd: EtcdStore, keys: JobKeys, n_events: int = 70) -> None:
    etcd.put(keys.config, json.dumps(OLD))
    for i in range(n_events):  # more than one transaction's worth
        etcd.put(keys.event(i), json.dumps({"i": i, "pad": "x" * 100}))
    etcd.put(keys.node("still"), "{}", lease=etcd.grant_lease(30))  # keys on a lease keep theirs
    etcd.put(keys.state, json.dumps(ENDED))


def test_an_ended_jobs_keys_are_put_on_one_lease_by_nodes_leaving_at_once(etcd: EtcdStore, job_id: str) -> None:
    keys = JobKeys(job_id)
    _real_ended_job(etcd, keys)
    moved: List[int] = []
    threads = [threading.Thread(target=lambda n=n: moved.append(expire(etcd, keys, n, 60))) for n in "abc"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    kvs, _ = etcd.get_prefix(keys.prefix)
    expiry = json.loads(etcd.get(keys.expiry).value)
    loose = [kv.key for kv in kvs if kv.key != keys.node("still") and kv.lease != expiry["lease"]]
    assert not loose, f"keys without the expiry lease: {loose}"
    assert sum(moved) == 72, "each key was moved once (config, 70 events, state)"
    ttl = etcd.lease_ttl(expiry["lease"])
    assert ttl is not None and 50 <= ttl["ttl"] <= 60
    assert etcd.get(keys.node("still")).lease != expiry["lease"]


def test_ended_keys_vanish_after_the_ttl_and_a_running_job_is_left_alone(etcd: EtcdStore, job_id: str) -> None:
    keys = JobKeys(job_id)
    etcd.put(keys.config, json.dumps(OLD))
    assert expire(etcd, keys, "a", 2) == 0 and etcd.get(keys.config).lease == 0, "a running job keeps its keys"
    etcd.put(keys.state, json.dumps(ENDED))
    assert expire(etcd, keys, "a", 2) == 2
    wait_until(lambda: not etcd.get_prefix(keys.prefix)[0], 30, "the ended job's keys to expire")


def test_stop_if_last_writes_nothing_while_a_node_is_registered_or_the_job_ended(etcd: EtcdStore,
                                                                                 job_id: str) -> None:
    keys = JobKeys(job_id)
    etcd.put(keys.node("n"), "{}", lease=etcd.grant_lease(30))
    assert not stop_if_last(etcd, keys, "left") and etcd.get(keys.state) is None
    etcd.delete(keys.node("n"))
    etcd.put(keys.state, json.dumps(ENDED))
    assert not stop_if_last(etcd, keys, "left") and json.loads(etcd.get(keys.state).value) == ENDED
    etcd.delete(keys.state)
    assert stop_if_last(etcd, keys, "left", 130)
    assert json.loads(etcd.get(keys.state).value)["exit_code"] == 130
