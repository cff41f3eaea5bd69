"""--hang-timeout: a round whose reported step stops advancing is dumped (every worker's stacks) and
restarted under the restart budget. Real agent, etcd and worker processes; the watch's rule with a fake clock.
"""

from __future__ import annotations

import re
from typing import Any, List

import pytest

from elasticrun.cli.run_config import build_config
from elasticrun.errors import StoreError
from elasticrun.launch.hang import HangWatch

from helpers.launch import SCRIPTS, run_cli

WORKER = str(SCRIPTS / "hang_worker.py")


def test_the_watch_judges_only_reports_of_its_round_and_only_after_the_first() -> None:
    now = [0.0]
    reports: List[Any] = [None]

    def read() -> Any:
        value = reports[0]
        if isinstance(value, Exception):
            raise value
        return value

    watch = HangWatch(read, 2.0, clock=lambda: now[0])
    watch.start_round(3)

    def at(t: float, report: Any) -> bool:
        now[0], reports[0] = t, report
        watch.poll()
        return watch.hung()

    assert not at(100.0, None), "no report yet: a script that never reports is never hung"
    assert not at(200.0, {"step": 7, "round": 2}) and watch.stalled_for() == 0.0, "a previous round's report"
    assert not at(201.0, {"step": 1, "round": 3})
    assert not at(202.5, {"step": 2, "round": 3}) and watch.step == 2
    assert not at(210.0, StoreError("etcd down")), "an etcd outage is not a hang: only successful reads count"
    assert not at(210.1, {"step": 2, "round": 3}), "after an outage the reporter may not have written yet"
    assert at(212.2, {"step": 2, "round": 3}) and watch.stalled_for() == pytest.approx(2.1)
    assert not at(300.0, {"step": 2, "round": 3, "closed": True}), "the reporter closed: training is over"
    watch.start_round(4)
    assert not at(400.0, {"step": 2, "round": 3}), "a new round starts unjudged"


def _parse(args: List[str], env: dict) -> Any:
    from elasticrun.cli.torchrun_args import parse

    return build_config(parse([*args, "--standalone", "train.py"], env))


def test_hang_timeout_comes_from_the_flag_or_the_variable() -> None:
    assert _parse([], {}).hang_timeout == 0.0
    assert _parse([], {"ELASTICRUN_HANG_TIMEOUT": "45"}).hang_timeout == 45.0
    assert _parse(["--hang-timeout", "7.5"], {"ELASTICRUN_HANG_TIMEOUT": "45"}).hang_timeout == 7.5


def test_a_hung_round_shows_every_workers_stack_and_restarts() -> None:
    # --no-prewarm: fresh workers, the unmodified `python script.py` path; forked and pre-warmed ones get the
    # same bootstrap (warm.py's _become registers the stack dump for all three).
    proc = run_cli(["--standalone", "--node-id", "nodeH", "--nproc-per-node", "2", "--max-restarts", "1",
                    "--hang-timeout", "3", "--no-prewarm", WORKER], timeout=180)
    err = proc.stderr
    assert proc.returncode == 0, err
    for rank in (0, 1):  # faulthandler's frame line, with the worker's prefix: where each one stands
        assert re.search(rf"\[nodeH/{rank}\]:\s+File \".*hang_worker\.py\", line \d+ in stuck_here", err), err
    assert "no progress for 3 s; stacks above" in err, err
    assert "restarts 1/1" in err, err
    assert sorted(re.findall(r"done rank=(\d)", proc.stdout)) == ["0", "1"], proc.stdout


def test_without_hang_timeout_a_long_pause_is_left_alone() -> None:
    proc = run_cli(["--standalone", "--node-id", "nodeN", "--nproc-per-node", "1", "--max-restarts", "1", WORKER],
                   env={"HANG_FOR": "5"}, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "no progress" not in proc.stderr and "stuck_here" not in proc.stderr, proc.stderr
    assert "restarts 1/1" not in proc.stderr and "done rank=0" in proc.stdout
