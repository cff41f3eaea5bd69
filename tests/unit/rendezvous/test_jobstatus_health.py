"""The status document's health parts: straggler flags per member, the scores, excluded nodes; the view's lines."""

from __future__ import annotations

from elasticrun.cli.status_view import job_view
from elasticrun.rendezvous.jobstatus import build_job_status

from .test_jobstatus import JOB, K, kv, node, topology


def scores(round_: int, nodes, drain=()):
    return kv(K.stragglers, {"round": round_, "time": 1.0, "threshold": 1.2, "window_s": 30.0, "median_s": 0.1,
                             "ranks": {"2": {"node": "b", "compute_s": 0.25, "ratio": 2.5, "straggler": True,
                                             "slow_since": 0.0}},
                             "nodes": nodes, "drain": list(drain)})


def test_a_straggler_member_is_flagged_with_its_ratio_and_shown():
    kvs = [topology(3, ["a", "b"], [11, 12]), node("a", 11), node("b", 12), scores(3, {"b": 2.5}, ["b"])]
    doc = build_job_status(JOB, kvs, 1, now=10.0)
    a, b = doc["members"]
    assert (a["straggler"], b["straggler"], b["straggler_ratio"]) == (False, True, 2.5)
    assert doc["stragglers"]["drain"] == ["b"]
    view = job_view(doc, 10.0)
    assert view.members is not None and "straggler 2.50×" in view.members.rows[1][4].text
    assert any("straggler: b: compute 2.50×" in line.text and "draining" in line.text for line in view.ending)


def test_scores_of_an_earlier_round_flag_nobody():
    kvs = [topology(4, ["a", "b"], [11, 12]), node("a", 11), node("b", 12), scores(3, {"b": 2.5})]
    doc = build_job_status(JOB, kvs, 1, now=10.0)
    assert doc["stragglers"] is None and not any(m["straggler"] for m in doc["members"])


def test_excluded_nodes_are_listed_and_a_malformed_record_is_left_out():
    kvs = [topology(4, ["a"], [11]), node("a", 11),
           kv(K.excluded_of("c"), {"reason": "cpu matmul (1 thread): 1 GFLOP/s is below 2", "why": "node-check",
                                  "time": 5.0}),
           kv(K.excluded_of("d"), {"why": 3})]
    doc = build_job_status(JOB, kvs, 1, now=10.0)
    assert [(e["node_id"], e["why"]) for e in doc["excluded"]] == [("c", "node-check")]
    assert any(line.text.startswith("excluded: c (node-check") for line in job_view(doc, 10.0).ending)
