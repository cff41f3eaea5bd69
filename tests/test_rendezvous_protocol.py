"""The rendezvous protocol on an in-memory store (tests/helpers/fake_store.py): forming rounds, stable
ranks, failures, lost nodes, success and the restart budget — no etcd, no processes."""

from __future__ import annotations

import pytest

from elasticrun.errors import ConfigError
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.protocol import JobEnded, Rendezvous
from elasticrun.rendezvous.records import NodeInfo, RescaleType
from elasticrun.rendezvous.states import JobState, RoundOutcome

from helpers.fake_store import FakeStore
from helpers.rdzv import JOB, join, next_rounds, seen, settings

pytestmark = pytest.mark.integration  # starts etcd or processes


def test_two_nodes_form_one_round_with_stable_ranks(store: FakeStore, cleanup):
    a, b = join(store, "a", nproc=2), join(store, "b")
    cleanup += [a, b]
    rounds = next_rounds([a, b])
    assert rounds["a"] == rounds["b"], "both nodes see the one topology written for the round"
    topo = rounds["a"]
    assert topo.round == 0 and topo.world_size == 3 and topo.restart_count == 0
    assert [(m.node_id, m.group_rank, m.rank_offset) for m in topo.members] == [("a", 0, 0), ("b", 1, 2)]
    event = a.rescale_event(0)
    assert event is not None and event.type is RescaleType.START
    assert a.round_change(topo) is None, "a round without failure, end or loss runs on"


def test_a_failure_ends_the_round_and_the_next_one_is_a_restart(store: FakeStore, cleanup):
    a, b = join(store, "a"), join(store, "b")
    cleanup += [a, b]
    first = next_rounds([a, b])["a"]
    b.report_failure(first, [{"rank": 1, "exitcode": 3}])
    assert seen(b, lambda: b.round_change(first)) == "worker failure on b"
    assert seen(a, lambda: a.round_change(first)) == "worker failure on b"
    second = next_rounds([a, b])["b"]
    assert second.round == 1 and second.restart_count == 1
    assert [m.node_id for m in second.members] == ["a", "b"], "same members, same ranks"
    assert a.rescale_event(1).type is RescaleType.RESTART
    assert a.root_cause(0) and a.root_cause(0)[0]["rank"] == 1


def test_restarts_run_out_and_the_job_fails(store: FakeStore, cleanup):
    a = join(store, "a", max_restarts=0)
    cleanup.append(a)
    topo = next_rounds([a])["a"]
    a.report_failure(topo, [{"rank": 0, "exitcode": 1}])
    with pytest.raises(JobEnded) as ended:
        a.next_round()
    assert not ended.value.succeeded
    assert store.get_json(JobKeys(JOB).state)["state"] == JobState.FAILED.value


def test_a_lost_node_ends_the_round_and_the_survivor_scales_down(store: FakeStore, cleanup):
    a, b = join(store, "a"), join(store, "b")
    cleanup.append(a)
    first = next_rounds([a, b])["a"]
    b.lease.stop()
    store.expire(b.lease.lease_id)  # b's agent died: etcd deletes its record when the lease expires
    assert seen(a, lambda: a.round_change(first)) == "node b left or lost its lease"
    second = next_rounds([a])["a"]
    assert second.round == 1 and [m.node_id for m in second.members] == ["a"]
    assert a.rescale_event(1).type is RescaleType.SCALE_DOWN and second.restart_count == 0


def test_a_round_already_done_when_the_leader_first_checks_its_members_succeeds(store: FakeStore, cleanup):
    """The leader's first look at a round also checks the node records. When every member has already
    reported done (a short job on a loaded host), that same look ends the round in success: it used to
    raise AttributeError ('Ended' has no 'checked') out of the agent, a traceback to the user."""
    a = join(store, "a")
    cleanup.append(a)
    topo = next_rounds([a])["a"]
    a.report_done(topo)
    assert seen(a, lambda: a.view.under(a.keys.dones(topo.round))), "a's done record"
    assert a.view.mirrors_nodes, "a leads: its look at the round checks the node records"
    assert a.round_change(topo) is RoundOutcome.SUCCEEDED


def test_all_done_is_success_and_ends_the_job(store: FakeStore, cleanup):
    a, b = join(store, "a"), join(store, "b")
    cleanup += [a, b]
    topo = next_rounds([a, b])["a"]
    a.report_done(topo)
    assert seen(a, lambda: a.view.under(a.keys.dones(topo.round))), "a's done record"
    assert a.round_change(topo) is None, "one node done is not the job done"
    b.report_done(topo)
    assert seen(a, lambda: a.round_change(topo)) is RoundOutcome.SUCCEEDED
    a.mark_succeeded(topo)
    with pytest.raises(JobEnded) as ended:
        b.next_round()
    assert ended.value.succeeded


def test_mismatched_settings_and_duplicate_node_ids_are_refused(store: FakeStore, cleanup):
    a = join(store, "a")
    cleanup.append(a)
    other = Rendezvous(store, settings(), NodeInfo(node_id="x", host="h", addr="a", nproc=1, pid=2), lambda: 1)
    with pytest.raises(ConfigError, match="runs with different settings"):
        other.ensure_config({"nnodes": "2", "entrypoint": "train.py"})
    twin = Rendezvous(store, settings(), NodeInfo(node_id="a", host="h", addr="a", nproc=1, pid=3), lambda: 1)
    with pytest.raises(ConfigError, match="already registered"):
        twin.register()
