"""The restart budget (``--max-restarts`` within ``--restart-window``) with a fake clock, and its CLI."""

from __future__ import annotations

import pytest

from elasticrun.errors import ConfigError
from elasticrun.rendezvous.restarts import RestartBudget, format_window, parse_window

pytestmark = pytest.mark.integration  # starts etcd or processes

HOUR = 3600.0


@pytest.mark.parametrize("text,seconds", [("1h", 3600), ("30m", 1800), ("90s", 90), ("2d", 172800), ("600", 600),
                                          ("1.5h", 5400), ("", 0), ("0", 0), (None, 0), (" 2H ", 7200)])
def test_parse_window(text, seconds):
    assert parse_window(text) == seconds


@pytest.mark.parametrize("bad", ["1w", "an hour", "-1h", "1h30m"])
def test_parse_window_rejects_with_one_line(bad):
    with pytest.raises(ConfigError, match=r"--restart-window .*: give a duration like 1h"):
        parse_window(bad)


def test_format_window():
    assert [format_window(s) for s in (3600, 7200, 90, 120, 86400, 1.5)] == ["1h", "2h", "90s", "2m", "1d", "1.5s"]


def test_without_window_the_budget_is_for_the_whole_job():
    budget = RestartBudget(2)
    assert budget.allows(0, [], 0) and budget.allows(1, [], 10 * HOUR)
    assert not budget.allows(2, [], 1000 * HOUR), "no window: restarts never come back"
    assert budget.describe() == "2 restart(s)"


def test_rare_crashes_never_exhaust_a_windowed_budget():
    """Weeks of a crash every 40 minutes with 2 restarts per hour: never out of restarts."""
    budget = RestartBudget(2, HOUR)
    history: list = []
    now = 0.0
    for restarts in range(500):  # ~2 weeks
        assert budget.allows(restarts, history, now), f"restart {restarts} at {now / HOUR:.1f}h refused"
        history = budget.record(history, now)
        assert len(history) <= 3, "the stored history stays small"
        now += 40 * 60


def test_a_crash_loop_still_ends_the_job():
    budget = RestartBudget(3, HOUR)
    history: list = []
    for i, now in enumerate([0.0, 10.0, 20.0]):
        assert budget.allows(i, history, now)
        history = budget.record(history, now)
    assert not budget.allows(3, history, 30.0), "4th restart within the hour"
    assert budget.used(3, history, 30.0) == 3
    assert budget.allows(3, history, HOUR + 0.5), "the first restart has left the window"
    assert budget.used(3, history, HOUR + 15.0) == 1
    assert budget.describe() == "3 restart(s) within 1h"


def test_zero_restarts_and_bad_values():
    assert not RestartBudget(0, HOUR).allows(0, [], 0.0)
    with pytest.raises(ConfigError, match="--max-restarts -1"):
        RestartBudget(-1)
    with pytest.raises(ConfigError, match="--restart-window"):
        RestartBudget(1, -5.0)


def test_cli_bad_window_is_one_clear_line(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "t.py"
    script.write_text("pass\n")
    proc = subprocess.run([sys.executable, "-m", "elasticrun", "--standalone", "--restart-window", "soon",
                           str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--restart-window 'soon': give a duration like 1h" in proc.stderr
    assert "Traceback" not in proc.stderr


FLAKY = """
import os, sys, time
runs = sys.argv[1]
n = len(os.listdir(runs))
open(os.path.join(runs, "run%d" % n), "w").close()
time.sleep(1.5)
sys.exit(1 if n < 2 else 0)
"""


def _flaky_job(etcd_server, job_id, agents, tmp_path, window):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    runs = tmp_path / f"runs-{window}"
    runs.mkdir()
    agent = agents(["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint", etcd_server.endpoint,
                    "--rdzv-id", f"{job_id}-{window}", "--max-restarts", "1", "--restart-window", window,
                    str(script), str(runs)], name=f"agent-{window}")
    return agent, runs


def test_window_lets_rare_crashes_through_real_agents(etcd_server, etcd, job_id, agents, tmp_path):
    """--max-restarts 1: two crashes 1.5 s apart pass a 1 s window, and the 2nd crash ends a 1h one."""
    from elasticrun.job.keys import JobKeys

    # two independent jobs (their own ids and folders) at the same time: most of each is waiting
    agent, runs = _flaky_job(etcd_server, job_id, agents, tmp_path, "1s")
    agent_h, runs_h = _flaky_job(etcd_server, job_id, agents, tmp_path, "1h")
    assert agent.wait(120) == 0, agent.output()[-3000:]
    assert len(list(runs.iterdir())) == 3, "2 failed attempts and the one that succeeded"
    times = etcd.get_json(JobKeys(f"{job_id}-1s").restarts)["times"]
    assert 1 <= len(times) <= 2 and times == sorted(times), times

    agent, runs = agent_h, runs_h
    assert agent.wait(120) != 0
    assert len(list(runs.iterdir())) == 2, "one restart, then the budget for the hour is used up"
    assert "all 1 restart(s) within 1h are used up" in agent.output()
