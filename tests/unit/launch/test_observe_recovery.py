"""How a worker-failure round recovered: the ``restart`` event's ``recovery`` and
``elasticrun_recoveries_total{how}`` (launch/observe.py, launch/metrics.py), from the round record alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import generate_latest

from elasticrun.launch.config import LaunchConfig
from elasticrun.launch.metrics import Metrics
from elasticrun.launch.observe import Observer
from elasticrun.rendezvous.records import Member, RescaleEvent, RescaleType, Topology

MEMBERS = (Member("A", "h", "127.0.0.1", 1, 0, 0, lease=1), Member("B", "h", "127.0.0.1", 1, 1, 1, lease=2))


def _restart(round_: int) -> RescaleEvent:
    return RescaleEvent(RescaleType.RESTART, round_, ["A", "B"], ["A", "B"], 2, 2, "worker failure", round_)


def test_a_restart_round_says_whether_it_recovered_in_place(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    obs = Observer(LaunchConfig.of({"workers.entrypoint": "t.py", "rendezvous.rdzv_id": "j",
                                     "rendezvous.node_id": "A", "logs.events_file": str(events)}))
    obs.round_started(Topology(1, MEMBERS, "127.0.0.1", 1, restart_count=1, inplace=("A",)), _restart(1))
    obs.round_started(Topology(2, MEMBERS, "127.0.0.1", 1, restart_count=2), _restart(2))
    obs.round_started(Topology(3, MEMBERS, "127.0.0.1", 1, restart_count=2, inplace=("A",)),
                      RescaleEvent(RescaleType.SCALE_UP, 3, ["A"], ["A", "B"], 1, 2, "join"))
    sat_out = RescaleEvent(RescaleType.SCALE_DOWN, 4, ["A", "B"], ["A"], 2, 1, "worker failure", 3, recovers=True)
    obs.round_started(Topology(4, MEMBERS[:1], "127.0.0.1", 1, restart_count=3, inplace=("A",)), sat_out)
    obs.close()
    rows = [json.loads(line) for line in events.read_text().splitlines()]
    assert [r.get("recovery") for r in rows if r["event"] == "restart"] == ["in_place", "restart", "in_place"]
    assert [r.get("type") for r in rows if r["event"] == "rescale"] == ["ScaleUp", "ScaleDown"]
    assert obs.snapshot()["recoveries"] == {"in_place": 2, "restart": 1}, "a planned re-form is no recovery"
    text = generate_latest(Metrics("j", "A", obs.snapshot).registry).decode()
    got = dict(re.findall(r'^elasticrun_recoveries_total\{how="(\w+)"[^}]*\} (\S+)$', text, re.M))
    assert got == {"in_place": "2.0", "restart": "1.0"}, text


def test_a_rescale_round_says_whether_the_nodes_that_stayed_kept_their_workers(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    obs = Observer(LaunchConfig.of({"workers.entrypoint": "t.py", "rendezvous.rdzv_id": "j",
                                     "rendezvous.node_id": "A", "logs.events_file": str(events)}))
    obs.round_started(Topology(1, MEMBERS, "127.0.0.1", 1, inplace=("A",)),
                      RescaleEvent(RescaleType.SCALE_UP, 1, ["A"], ["A", "B"], 1, 2, "join"))
    obs.round_started(Topology(2, MEMBERS[:1], "127.0.0.1", 1),
                      RescaleEvent(RescaleType.SCALE_DOWN, 2, ["A", "B"], ["A"], 2, 1, "leave"))
    obs.close()
    rows = [json.loads(line) for line in events.read_text().splitlines() if '"rescale"' in line]
    assert [(r["type"], r["recovery"]) for r in rows] == [("ScaleUp", "in_place"), ("ScaleDown", "restart")]
