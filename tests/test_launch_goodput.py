"""Goodput accounting (elasticrun.launch.goodput) with a fake clock, the event log, and the metrics endpoint."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

from elasticrun.errors import ConfigError
from elasticrun.launch.events import EventKind, EventLog
from elasticrun.launch.goodput import Cause, Goodput, Phase, aggregate, rollback_marks
from elasticrun.launch.metrics import Metrics


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float) -> None:
        self.t += dt


def _invariant(g: Goodput) -> None:
    assert g.goodput_s + sum(g.badput.values()) == pytest.approx(g.wall_s)
    assert sum(g.phase_seconds.values()) == pytest.approx(g.wall_s)


def test_a_crash_with_rollback_a_stall_and_an_outage():
    """Scripted: 2 s start-up, steps 0..30 at 0.1 s/step with a 0.5 s checkpoint at step 20, crash at
    step 30, 1.5 s restart, round 2 restores step 20 and trains to step 50, an outage of 2 s."""
    c = Clock()
    g = Goodput(clock=c)
    c.tick(1.0)  # rendezvous
    g.enter(Phase.STARTING)
    c.tick(1.0)  # workers import torch
    g.report(0)
    for step in range(1, 31):
        c.tick(0.1)
        g.report(step, stall_s=0.5 if step > 20 else 0.0)  # the checkpoint after 20 blocked 0.5 s ...
        if step == 20:
            c.tick(0.5)  # ... of wall time, reported with the next step
    assert g.badput[Cause.STARTUP] == pytest.approx(2.0)
    assert g.badput[Cause.CHECKPOINT_STALL] == pytest.approx(0.5)
    g.enter(Phase.RESTARTING, Cause.RESTART)
    c.tick(0.5)  # stopping workers
    g.enter(Phase.RENDEZVOUS)
    c.tick(0.5)
    g.enter(Phase.STARTING)
    c.tick(0.5)
    g.report(20)  # restored from the checkpoint of step 20: steps 21..30 (1.0 s) are lost
    assert g.steps_lost == 10
    assert g.badput[Cause.ROLLBACK] == pytest.approx(1.0)
    assert g.badput[Cause.RESTART] == pytest.approx(1.5)
    for step in range(21, 51):
        c.tick(0.1)
        g.report(step)
        if step == 35:
            g.enter(Phase.OUTAGE)
            c.tick(2.0)
            g.enter(Phase.TRAINING)
    c.tick(0.7)  # the workers exit, the agent reports success: no step trained
    g.finish()
    c.tick(100.0)  # after the end: not counted
    _invariant(g)
    kept = 50 * 0.1  # steps 1..50, each kept once
    assert g.goodput_s == pytest.approx(kept)
    assert g.badput[Cause.OUTAGE] == pytest.approx(2.0)
    assert g.badput[Cause.SHUTDOWN] == pytest.approx(0.7)
    assert g.wall_s == pytest.approx(2.0 + 3.0 + 0.5 + 1.5 + 3.0 + 2.0 + 0.7)
    assert g.ratio == pytest.approx(kept / g.wall_s)
    s = g.summary()
    assert s["steps_lost"] == 10 and s["step"] == 50 and s["phase_s"]["outage"] == pytest.approx(2.0)


def test_a_late_report_is_dated_back_and_a_rescale_is_charged_to_rescale():
    c = Clock()
    g = Goodput(clock=c)
    g.enter(Phase.STARTING)
    c.tick(3.0)
    g.report(0, at=c.t - 1.0)  # read 1 s after the worker wrote it: training began 1 s ago
    assert g.badput[Cause.STARTUP] == pytest.approx(2.0) and g.goodput_s == pytest.approx(1.0)
    g.enter(Phase.RESCALING, Cause.RESCALE)
    c.tick(1.0)
    g.enter(Phase.RENDEZVOUS)
    c.tick(1.0)
    g.enter(Phase.STARTING)
    c.tick(1.0)
    g.report(10)  # a snapshot at the stop: nothing lost
    assert g.badput[Cause.RESCALE] == pytest.approx(3.0) and g.badput[Cause.ROLLBACK] == 0
    assert g.steps_lost == 0
    _invariant(g)


def test_rollback_interpolates_between_sparse_reports():
    c = Clock()
    g = Goodput(clock=c)
    g.enter(Phase.STARTING)
    g.report(0)
    c.tick(10.0)
    g.report(100)  # reports every 10 s only
    c.tick(10.0)
    g.enter(Phase.RESTARTING, Cause.RESTART)
    g.enter(Phase.STARTING)
    g.report(50)  # step 50 was reached at 5 s: 15 s lost
    assert g.badput[Cause.ROLLBACK] == pytest.approx(15.0)
    assert g.goodput_s == pytest.approx(5.0)
    _invariant(g)


def test_steps_lost_count_from_the_restored_step_to_the_last_step_reached():
    """Reports reach the agent at most once a second: the last one seen says step 26 although the
    workers reached 37, and the restarted round's first report says 33 although it resumed from 30.
    The reporter's marks (restored 30, reached 37) make it 7 steps, not 26 - 33 (nothing)."""
    c = Clock()
    g = Goodput(clock=c)
    g.enter(Phase.STARTING)
    for step in (1, 6, 11, 16, 21, 26):  # what the agent saw of steps 1..37
        c.tick(0.5)
        g.report(step)
    c.tick(0.55)  # steps 27..37, then the crash
    g.enter(Phase.RESTARTING, Cause.RESTART)
    c.tick(1.0)
    g.enter(Phase.STARTING)
    c.tick(0.5)
    g.report(33, restored=30, reached=37)
    assert g.steps_lost == 7
    # Steps 26..37 took the last 0.55 s of training: step 30 was reached 0.2 s into them, 0.35 s were lost.
    assert g.badput[Cause.ROLLBACK] == pytest.approx(0.35)
    g2 = Goodput(clock=c)  # without marks (a script that restores by itself): the reports are all there is
    g2.enter(Phase.STARTING)
    g2.report(10)
    g2.enter(Phase.RESTARTING, Cause.RESTART)
    g2.enter(Phase.STARTING)
    g2.report(4)
    assert g2.steps_lost == 6
    assert rollback_marks({"restored": 3, "reached": True}) == {"restored": 3, "reached": None}
    assert rollback_marks({"restored": "3", "reached": -1}) == {"restored": None, "reached": None}
    _invariant(g)


def test_aggregate_weights_nodes_by_their_wall_time():
    a = {"wall_s": 100.0, "goodput_s": 90.0, "badput_s": {"startup": 10.0}, "steps_lost": 0}
    b = {"wall_s": 50.0, "goodput_s": 30.0, "badput_s": {"startup": 5.0, "restart": 15.0}, "steps_lost": 3}
    job = aggregate([a, b])
    assert job["goodput_ratio"] == pytest.approx(120 / 150)
    assert [t["cause"] for t in job["top_badput"]] == ["startup", "restart"]
    assert job["steps_lost"] == 3 and aggregate([])["goodput_ratio"] is None


def test_event_log_writes_json_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(str(path), "job1", "n1")
    log.emit(EventKind.ROUND_FORMED, round=0, world_size=2)
    log.emit(EventKind.RESTART, round=1)
    log.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in rows] == ["round_formed", "restart"]
    assert rows[0]["job"] == "job1" and rows[0]["node"] == "n1" and rows[0]["world_size"] == 2
    with pytest.raises(ConfigError, match="--events-file"):
        EventLog(str(tmp_path / "missing" / "e.jsonl"), "j", "n")


def _scrape(port: int, openmetrics: bool = False) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if openmetrics:
        req.add_header("Accept", "application/openmetrics-text")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read().decode()


def test_metrics_endpoint_text_openmetrics_busy_port_and_a_scrape_storm():
    c = Clock()
    g = Goodput(clock=c)
    g.enter(Phase.STARTING)
    c.tick(1.0)
    g.report(7)
    c.tick(1.0)
    state = {"round": 3, "world_size": 4, "nodes": 2, "restarts": 1, "rescales": {"ScaleUp": 2},
             "role": "leader", "lease": "held", "samples_per_s": 12.5}
    m = Metrics("job1", "n1", lambda: dict(state, **g.summary(), counters=g.counters()))
    port = m.serve("127.0.0.1", 0)
    try:
        m.observe_etcd("get", 0.002)
        m.checkpoint.observe(0.4)
        text = _scrape(port)
        for line in ('elasticrun_world_size{job_id="job1",node_id="n1"} 4.0',
                     'elasticrun_step{job_id="job1",node_id="n1"} 7.0',
                     'elasticrun_restarts_total{job_id="job1",node_id="n1"} 1.0',
                     'elasticrun_rescales_total{job_id="job1",node_id="n1",type="ScaleUp"} 2.0',
                     'elasticrun_phase_seconds_total{job_id="job1",node_id="n1",phase="training"} 1.0',
                     'elasticrun_goodput_ratio{job_id="job1",node_id="n1"} 0.5',
                     'elasticrun_lease_state{job_id="job1",node_id="n1",state="held"} 1.0',
                     'elasticrun_agent_info{job_id="job1",node_id="n1",role="leader"} 1.0',
                     'elasticrun_etcd_request_seconds_count{job_id="job1",node_id="n1",op="get"} 1.0',
                     'elasticrun_checkpoint_seconds_count{job_id="job1",node_id="n1"} 1.0'):
            assert line in text.splitlines(), line
        om = _scrape(port, openmetrics=True)
        assert om.rstrip().endswith("# EOF") and "elasticrun_restarts_total" in om
        with pytest.raises(ConfigError, match=f"--metrics-port {port}: cannot listen"):
            Metrics("job1", "n2", lambda: {}).serve("127.0.0.1", port)
        errors: list = []

        def storm() -> None:
            for _ in range(20):
                try:
                    assert "elasticrun_step" in _scrape(port)
                except Exception as err:  # noqa: BLE001 - every failure counts
                    errors.append(err)

        threads = [threading.Thread(target=storm) for _ in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == [] and not any(t.is_alive() for t in threads)
    finally:
        m.close()
