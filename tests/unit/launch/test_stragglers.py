"""The leader's side of straggler detection: readings from progress reports, and the record it writes."""

from __future__ import annotations

import json

from elasticrun.health.straggler import Reading, StragglerPolicy, StragglerTracker
from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.launch.stragglers import readings, record_of
from elasticrun.store.types import KeyValue

K = JobKeys("j")


def kv(node: str, value: object) -> KeyValue:
    return KeyValue(K.progress_of(node), json.dumps(value).encode(), 1, 1, 0)


def test_readings_take_this_rounds_open_reports_only():
    kvs = [kv("a", {"step": 5, "round": 2, "time": 10.0, "compute": {"0": 0.1, "1": 0.12}}),
           kv("b", {"step": 5, "round": 1, "time": 10.0, "compute": {"2": 0.5}}),  # an earlier round
           kv("c", {"step": 5, "round": 2, "time": 10.0, "closed": True, "compute": {"3": 0.5}}),
           kv("d", {"step": 5, "round": 2, "time": 10.0}),  # a script that times nothing
           kv("e", {"step": "x"})]  # malformed: reported, ignored
    assert readings(kvs, 2) == [Reading(0, "a", 0.1, 10.0), Reading(1, "a", 0.12, 10.0)]


def test_the_record_passes_its_own_check():
    t = StragglerTracker(StragglerPolicy(window_s=0.0))
    a = t.observe(3, [Reading(0, "a", 0.1, 1.0), Reading(1, "b", 0.1, 1.0), Reading(2, "c", 0.3, 1.0)], now=1.0)
    rec = record_of(a, t.policy, ["c"], 1.0)
    assert records.straggler_record(json.loads(json.dumps(rec))) == json.loads(json.dumps(rec))
    assert rec["nodes"] == {"c": 3.0} and rec["ranks"]["2"]["straggler"] is True and rec["drain"] == ["c"]
