"""job_view: a status document -> the lines and rows `elasticrun status` shows (no rich, no clock)."""

from __future__ import annotations

from typing import Any, Dict

from elasticrun.cli.status_view import (
    Styled,
    accelerators_cell,
    ago,
    heartbeat_cell,
    job_view,
    lease_cell,
    progress_cell,
    ranks_cell,
)
from elasticrun.rendezvous.jobstatus import build_job_status

NOW = 10_000.0


def doc(**fields: Any) -> Dict[str, Any]:
    d = build_job_status("j1", [], 3, now=NOW)
    d.update({"exists": True, **fields})
    return d


def member(node_id: str, status: str = "Active", **fields: Any) -> Dict[str, Any]:
    row = {"group_rank": 0, "node_id": node_id, "host": "h", "addr": "10.0.0.1", "status": status, "ranks": [0, 1],
           "accelerators": [], "registered": True, "lease_ttl": None, "heartbeat_at": NOW - 2, "progress": None}
    row.update(fields)
    return row


def test_cells():
    assert [ago(None, NOW), ago(NOW - 5, NOW), ago(NOW - 600, NOW), ago(NOW - 7200, NOW), ago(NOW + 9, NOW)] == [
        "-", "5.0s ago", "10m ago", "2.0h ago", "0.0s ago"]
    assert [ranks_cell([]), ranks_cell([3]), ranks_cell([4, 5, 6, 7])] == ["-", "3", "4-7"]
    gpus = [{"type": "gpu", "name": "A100", "memory_gib": 80}] * 2 + [{"type": "cpu", "count": 16}]
    assert accelerators_cell(gpus) == "2x A100 (80 GiB), cpu x16" and accelerators_cell([]) == "-"
    assert heartbeat_cell({"lease_heartbeat_age": 3, "heartbeat_at": 1.0}, NOW) == "~3s ago"
    assert heartbeat_cell({"heartbeat_at": NOW - 1}, NOW) == "1.0s ago"
    assert [lease_cell({"lease_ttl": 7, "lease_granted_ttl": 10}), lease_cell({"registered": True}),
            lease_cell({"registered": False})] == ["7/10s", "-", "gone"]
    assert progress_cell({"step": 5, "loss": 0.123456, "samples_per_s": 3.333, "time": NOW - 2}, NOW) == (
        "step 5 · loss 0.1235 · 3.3/s · 2.0s ago")
    assert progress_cell(None, NOW) == "-"


def test_a_job_without_a_round():
    view = job_view(doc(), NOW)
    assert view.phase == Styled("forming", "cyan") and view.where == ""
    assert view.summary == (Styled("no round formed yet", "cyan"),)
    assert view.ending == () and view.members is None and view.spares is None and view.events is None


def test_the_heading_the_errors_and_a_missing_job():
    view = job_view(doc(exists=False, revision=9), NOW, "127.0.0.1:2379", "connection refused")
    assert view.where == "   etcd 127.0.0.1:2379, revision 9"
    assert [line.text for line in view.summary] == [
        "etcd: connection refused (retrying)", "the job has no keys in etcd (removed, or not started yet)",
        "no round formed yet"]
    assert view.summary[0].style == "bold red"


def test_a_running_round_and_its_members():
    d = doc(round=4, world_size=2, restart_count=1, max_restarts=3, nnodes="1:2", master_addr="10.0.0.1",
            master_port=29500, round_created_at=NOW - 30, members=[member("a", lease_ttl=9, lease_granted_ttl=10)])
    view = job_view(d, NOW)
    assert view.phase == Styled("running", "green")
    assert view.summary == (Styled("round 4 · world size 2 · 1 node(s) · restarts 1/3 · nnodes 1:2 · "
                                   "master 10.0.0.1:29500 · formed 30.0s ago"),)
    assert view.members is not None and view.members.title == "members"
    assert view.members.rows == (("0", "a", "h", "10.0.0.1", Styled("Active", "green"), "0-1", "-", "2.0s ago",
                                  "9/10s", "-"),)


def test_how_the_round_and_the_job_end():
    d = doc(round=2, members=[member("a", "Lost", registered=False)],
            state={"state": "failed", "reason": "too many restarts", "round": 2, "time": NOW - 60},
            round_end={"failed": {"node": "a", "rank": 1}, "end": {"reason": "ignored"}, "done": ["b", "c"]})
    view = job_view(d, NOW)
    assert view.phase == Styled("failed", "bold red")
    assert view.ending == (Styled("state: failed — too many restarts (round 2, 1m ago)", "bold red"),
                           Styled("round ending: worker failure on a (rank 1)", "red"),
                           Styled("finished: b, c", "green"))
    assert view.members is not None and view.members.rows[0][4] == Styled("Lost", "bold red")
    ended = job_view(doc(round=2, round_end={"end": {"reason": "scale up"}, "done": []}), NOW)
    assert ended.ending == (Styled("round ending: scale up", "yellow"),) and ended.phase.text == "rescaling"


def test_spares_are_waiting_nodes_once_a_round_exists():
    spare = {"node_id": "s", "host": None, "addr": "", "status": "Joining", "nproc": 4, "waiting_for": 3,
             "registered_at": NOW - 1, "registered": True, "lease_ttl": None}
    before = job_view(doc(spares=[dict(spare, waiting_for=-1)]), NOW)
    assert before.spares is not None and before.spares.title == "registered nodes"
    assert before.spares.rows == (("s", "-", "-", Styled("Joining", "cyan"), "4", "-", "1.0s ago", "-"),)
    during = job_view(doc(round=1, spares=[spare]), NOW)
    assert during.spares is not None and during.spares.title == "waiting nodes (not in the round)"
    assert during.spares.rows[0][5] == "round 3"


def test_events_verbatim_newest_first_as_given():
    e = {"round": 3, "type": "ScaleUp", "old_world_size": 2, "new_world_size": 4, "added": ["[b]x"], "removed": [],
         "reason": "joined", "time": NOW - 1}
    view = job_view(doc(events=[e, dict(e, round=2, reason=None, added=[], removed=["y"], kept=["a", "b"])]), NOW)
    assert view.events is not None and view.events.title == "rescale events (newest first)"
    assert view.events.rows == (("3", "ScaleUp", "2→4", "[b]x", "-", "-", "joined", "1.0s ago"),
                                ("2", "ScaleUp", "2→4", "-", "y", "a, b", "", "1.0s ago")), "kept: re-formed in place"


def test_a_phase_etcd_spells_otherwise_is_shown_unstyled():
    assert job_view(doc(phase="paused"), NOW).phase == Styled("paused", "")
