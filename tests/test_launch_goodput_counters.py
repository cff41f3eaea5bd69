"""Goodput as Prometheus sees it: the agent's counters never go down (a drop is a reset to
Prometheus), and the documented "goodput over the last hour" query, evaluated with Prometheus'
own ``increase()`` over 15 s scrapes, matches the ground truth of a scripted 70-minute job with a
crash and a 18-minute rollback; starting time of a script that never reports is ``unknown``; the
``status`` line is current between two reports of an agent."""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elasticrun.cli.goodput_view import goodput_line, with_goodput
from elasticrun.launch.goodput import REPORT_LAG_S, Cause, Goodput, Phase
from elasticrun.launch.metrics import Metrics

from helpers import promql

SCRAPE_S = 15.0
HOUR = 3600.0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


Series = Dict[Tuple[str, Tuple[Tuple[str, str], ...]], List[Tuple[float, float]]]


class Scraper:
    """Renders the agent's exposition every SCRAPE_S of the fake clock, as Prometheus would scrape it."""

    def __init__(self, clock: Clock, g: Goodput) -> None:
        self.clock, self.g = clock, g
        self.metrics = Metrics("job1", "n1", lambda: dict(g.summary(), counters=g.counters(), round=0))
        self.metrics.app.ttl = 0.0  # every scrape renders
        self.series: Series = defaultdict(list)
        self.counters: set = set()
        self.next = 0.0

    def until(self, t: float) -> None:
        """Scrape at every multiple of SCRAPE_S up to ``t`` (the clock stands at each)."""
        while self.next <= t:
            self.clock.t = self.next
            self.scrape()
            self.next += SCRAPE_S
        self.clock.t = t

    def scrape(self) -> None:
        text = self.metrics.app.render("")[1].decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                self.series[key].append((self.clock.t, s.value))
                if family.type == "counter":
                    self.counters.add(key)

    def matching(self, name: str, **labels: str) -> List[List[Tuple[float, float]]]:
        return [pts for (n, ls), pts in self.series.items() if n == name and labels.items() <= dict(ls).items()]

    def increase(self, name: str, end: float, window: float, **labels: str) -> float:
        """``sum(increase(name{labels}[window]))`` at ``end``: per series, then summed (as PromQL)."""
        found = [promql.increase(pts, end, window) for pts in self.matching(name, **labels)]
        assert found and None not in found, (name, labels)
        return float(sum(found))  # type: ignore[arg-type]


def _run_job(c: Clock, g: Goodput, scraper: Scraper) -> float:
    """A scripted job: 2 min start-up, steps of 1 s, a 5 s checkpoint after step 600 (its last
    checkpoint: step 1200, reached at 1325 s), a crash at 2400 s; the restart restores step 1200
    (first report read 1 s late); a 30 s etcd outage at 3000 s; the last step at 4197 s, the job
    ends at 4200 s. The kept training seconds in [600, 4200] are returned (the ground truth)."""
    scraper.until(30.0)
    g.enter(Phase.STARTING)
    scraper.until(120.0)
    step, stall = 0, 0.0
    g.report(step)
    for t in range(121, 2400):
        if 720 < t <= 725:
            continue  # the checkpoint after step 600 blocks training for 5 s
        scraper.until(float(t))
        step += 1
        stall = 5.0 if t > 725 else 0.0
        g.report(step, stall_s=stall)
    assert step == 2274  # reached at 2399 s
    scraper.until(2400.0)
    g.enter(Phase.RESTARTING, Cause.RESTART)  # a worker crashed
    scraper.until(2410.0)
    g.enter(Phase.RENDEZVOUS)
    scraper.until(2430.0)
    g.enter(Phase.STARTING)
    scraper.until(2520.0)
    step = 1200
    g.report(step, at=2519.0)  # restored step 1200, reported at 2519 s, read at 2520 s
    for t in range(2521, 4198):
        scraper.until(float(t))
        if t == 3000:
            g.outage(True)
        if 3000 <= t < 3030:
            continue
        if t == 3030:
            g.outage(False)
        step += 1
        g.report(step)
    scraper.until(4200.0)
    g.finish()
    scraper.until(4200.0 + 5 * SCRAPE_S)  # scraped on after the end: the counters stand still
    kept = (720 - 600) + (1325 - 725) + (4197 - 2519 - 30)
    return float(kept)


def test_counters_never_go_down_and_the_documented_hourly_query_matches_the_truth() -> None:
    c = Clock()
    g = Goodput(clock=c)
    scraper = Scraper(c, g)
    kept = _run_job(c, g, scraper)
    # the refined account (status) agrees with the script
    assert g.steps_lost == 2274 - 1200
    assert g.badput[Cause.ROLLBACK] == pytest.approx(2400 - 1325, abs=1e-6)
    assert g.badput[Cause.CHECKPOINT_STALL] == pytest.approx(5.0)
    assert g.badput[Cause.SHUTDOWN] == pytest.approx(3.0)
    # 1. no counter ever goes down (Prometheus would read a reset)
    assert len(scraper.counters) >= 20
    for key in scraper.counters:
        values = [v for _, v in scraper.series[key]]
        drops = [(a, b) for a, b in zip(values, values[1:]) if b < a]
        assert not drops, f"{key[0]}{dict(key[1])} went down: {drops[:3]}"
    # 2. docs/observability.md: training seconds less the training seconds found lost, over all
    # phases' seconds, each an increase() over the last hour
    end = 4200.0
    training = scraper.increase("elasticrun_phase_seconds_total", end, HOUR, phase="training")
    lost = scraper.increase("elasticrun_training_lost_seconds_total", end, HOUR)
    wall = scraper.increase("elasticrun_phase_seconds_total", end, HOUR)
    assert wall == pytest.approx(HOUR, abs=SCRAPE_S)
    truth = kept / HOUR
    assert (training - lost) / wall == pytest.approx(truth, abs=0.005), (training, lost, wall, kept)
    assert truth == pytest.approx(0.66, abs=0.01)
    # the whole job, from the first scrape to the last: the final account exactly
    whole = 4200.0 + 5 * SCRAPE_S
    good = (scraper.increase("elasticrun_phase_seconds_total", whole, whole, phase="training")
            - scraper.increase("elasticrun_training_lost_seconds_total", whole, whole))
    assert good == pytest.approx(g.goodput_s, abs=0.01)
    gauge = scraper.matching("elasticrun_goodput_seconds")[0]
    assert gauge[-1][1] == pytest.approx(g.goodput_s, abs=0.01)
    assert max(v for _, v in gauge) > gauge[-1][1], "the gauge may fall (a rollback): it is no counter"


def test_a_report_dated_back_takes_nothing_from_an_exported_counter() -> None:
    """Scraped while starting, then a report dated back REPORT_LAG_S (or more: clamped): the
    starting and startup counters shown before the report are never above what follows."""
    c = Clock()
    g = Goodput(clock=c)
    g.enter(Phase.STARTING)
    c.t = 10.0
    g.report(0)  # the script reports: later rounds' starting time is charged at once
    g.enter(Phase.RESTARTING, Cause.RESTART)
    g.enter(Phase.STARTING)
    c.t = 20.0
    before = g.counters()
    assert before["phase_s"]["starting"] == pytest.approx(10.0 + 10.0 - REPORT_LAG_S)  # both rounds
    g.report(0, at=c.t - 5.0)  # written 5 s before it was read: dated back REPORT_LAG_S only
    after = g.counters()
    for part in ("phase_s", "badput_s"):
        for key, value in before[part].items():
            assert after[part][key] >= value, (part, key, value, after[part][key])
    assert after["phase_s"]["training"] == pytest.approx(REPORT_LAG_S)


def test_an_unmodified_script_is_unknown_after_a_restart_not_restart() -> None:
    """A script that never reports progress: 2 s rendezvous, 30 s of running, a crash, 1.7 s to stop
    and re-form, 30 s again, then the job ends. Restart is the 1.7 s, not the 31.7 s."""
    c = Clock()
    g = Goodput(clock=c)
    c.t = 2.0
    g.enter(Phase.STARTING)
    c.t = 32.0
    assert g.summary()["badput_s"]["unknown"] == pytest.approx(30.0)  # status: unknown while it runs
    assert g.counters()["badput_s"]["unknown"] == 0.0, "not settled yet: a report may still come"
    g.enter(Phase.RESTARTING, Cause.RESTART)
    c.t = 33.0
    g.enter(Phase.RENDEZVOUS)
    c.t = 33.7
    g.enter(Phase.STARTING)
    c.t = 63.7
    g.finish()
    s = g.summary()
    assert s["badput_s"]["restart"] == pytest.approx(1.7)
    assert s["badput_s"]["startup"] == pytest.approx(2.0)
    assert s["badput_s"]["unknown"] == pytest.approx(60.0)
    assert g.counters()["badput_s"]["unknown"] == pytest.approx(60.0)
    assert s["goodput_s"] == 0.0 and s["wall_s"] == pytest.approx(63.7)


def _first_report_at(t: float) -> Tuple[Clock, Goodput]:
    """An account whose round started at 0 and whose script first reported (step 3) at ``t``."""
    c = Clock()
    g = Goodput(clock=c)
    g.enter(Phase.STARTING)
    c.t = t
    g.report(3)
    return c, g


def test_a_script_that_reports_later_has_its_start_up_charged_once_it_reports() -> None:
    _, g = _first_report_at(5.0)
    assert g.badput[Cause.STARTUP] == pytest.approx(5.0) and g.badput[Cause.UNKNOWN] == 0.0


def test_an_outage_while_starting_returns_to_starting_not_training() -> None:
    c, g = _first_report_at(1.0)
    g.enter(Phase.RESTARTING, Cause.RESTART)
    g.enter(Phase.STARTING)  # a new round: no report yet
    g.outage(True)
    c.t = 2.0
    g.outage(False)
    assert g.phase is Phase.STARTING
    c.t = 3.0
    g.report(3)
    assert g.phase_seconds[Phase.TRAINING] == 0.0, "the round trained from its first report on, not before"
    assert g.phase_seconds[Phase.STARTING] == pytest.approx(2.0)
    assert g.badput[Cause.OUTAGE] == pytest.approx(1.0) and g.badput[Cause.RESTART] == pytest.approx(1.0)


def test_status_extends_each_live_account_to_the_time_it_is_read() -> None:
    """An agent publishes its account every few seconds: ``status`` read between two of them adds
    the seconds since to the phase each node was in (training: goodput), not a stale figure."""
    c = Clock()
    g = Goodput(clock=c)
    g.enter(Phase.STARTING)
    c.t = 1.0
    g.report(0)  # the first report: published at once
    published = dict(g.summary(), time=1000.0)
    doc = with_goodput({"time": 1008.0, "goodput_nodes": {"n1": published}})
    assert doc["goodput"]["wall_s"] == pytest.approx(9.0)
    assert doc["goodput"]["goodput_s"] == pytest.approx(8.0)
    line = goodput_line(doc["goodput"])
    assert line is not None and line.plain.startswith("goodput 88.9% of 9 node-seconds")
    # a final account (the job ended) is not extended; a clock far off is bounded
    g.finish()
    final = dict(g.summary(), time=1000.0)
    assert with_goodput({"time": 5000.0, "goodput_nodes": {"n1": final}})["goodput"]["wall_s"] == pytest.approx(1.0)
    skewed = with_goodput({"time": 99999.0, "goodput_nodes": {"n1": published}})["goodput"]
    assert skewed["wall_s"] <= 1.0 + 30.0
    fresh = Goodput(clock=Clock())
    fresh.enter(Phase.STARTING)
    starting = dict(fresh.summary(), time=1000.0)  # an agent whose script has not reported yet
    assert with_goodput({"time": 1004.0, "goodput_nodes": {"n1": starting}})["goodput"]["badput_s"]["unknown"] == \
        pytest.approx(4.0)


def test_the_promql_helper_reads_a_drop_as_a_reset_and_extrapolates_as_prometheus() -> None:
    """The helper the tests above judge the counters with, on cases worked out by hand from
    Prometheus' extrapolatedRate."""
    dropped = [(0.0, 0.0), (15.0, 10.0), (30.0, 20.0), (45.0, 5.0), (60.0, 15.0)]
    assert promql.increase(dropped, 60.0, 60.0) == pytest.approx(15.0 + 20.0)  # 20 -> 5 is a reset: +20
    # samples 5 s after the range's start and 10 s before its end, 15 s apart: both edges within
    # 1.1 intervals, the zero point (15 s before the first) further than the start: 30 * 60 / 45
    inner = [(5.0, 10.0), (20.0, 20.0), (35.0, 30.0), (50.0, 40.0)]
    assert promql.increase(inner, 60.0, 60.0) == pytest.approx(40.0)
    assert promql.rate(inner, 60.0, 60.0) == pytest.approx(40.0 / 60.0)
    # the counter started at 0 just before the first sample: no extrapolation past its zero point
    fresh = [(30.0, 1.0), (45.0, 16.0), (60.0, 31.0)]
    assert promql.increase(fresh, 60.0, 60.0) == pytest.approx(30.0 * (30.0 + 1.0) / 30.0)
    assert promql.increase([(1.0, 5.0)], 60.0, 60.0) is None


def test_an_outage_returns_to_the_phase_it_interrupted() -> None:
    c, g = _first_report_at(1.0)
    g.enter(Phase.RESTARTING, Cause.RESTART)
    g.outage(True)
    c.t = 3.0
    g.outage(False)
    assert g.phase is Phase.RESTARTING, "stopping the workers goes on: not training"
    c.t = 4.0
    g.enter(Phase.STARTING)
    g.outage(True)
    c.t = 5.0
    g.report(3)  # read while etcd answered for a moment: the round trains once the outage ends
    g.outage(False)
    c.t = 6.0
    assert g.phase is Phase.TRAINING and g.badput[Cause.OUTAGE] == pytest.approx(3.0)
