"""``scripts/bench/bench_launch.py``: the commands it runs, the JSON summary of its scenarios, its log parsing."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "scripts" / "bench"


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201 - the bench module, imported as the script imports its siblings
    sys.path.insert(0, str(BENCH))
    try:
        import bench_launch

        yield bench_launch
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("launcher", ["elasticrun", "torchrun-default", "torchrun-best"])
def test_one_node_commands_allow_a_restart(bench, launcher: str) -> None:  # noqa: ANN001
    bench_launch = bench
    (cmd,) = bench_launch._commands(launcher, 1, 2, "", "job")
    assert "--standalone" in cmd
    assert cmd[cmd.index("--max-restarts") + 1] == "3", "the restart scenario crashes a worker once"


def test_restart_summary_has_a_row_per_crash_moment(bench) -> None:  # noqa: ANN001
    results = bench
    Run = results.Run
    runs = [Run("elasticrun", "restart", "ok", 0.5), Run("elasticrun", "restart", "ok", 0.7),
            Run("torchrun-default", "restart", "ok", 6.0), Run("torchrun-best", "restart", "fail"),
            Run("elasticrun", "restart", "ok", 0.4, crash_after=1.0),
            Run("torchrun-default", "restart", "hang", crash_after=1.0),
            Run("elasticrun", "launch", "ok", 3.0)]
    rows = results.summary_rows(runs, 2, 1, 60.0, "cmd")
    assert [r["metric"] for r in rows] == ["worker crash (step 3 into the round) -> first step, 1 x 2",
                                           "worker crash (1s into the round) -> first step, 1 x 2"]
    assert rows[0]["elasticrun"] == 0.6 and rows[0]["alt_value"] == 6.0 and rows[0]["ratio"] == 10.0
    assert rows[0]["alternative"] == "torchrun-default (1/1 ok)"
    assert rows[1]["alt_value"] == 60.0 and "timeout as lower bound" in rows[1]["alternative"]
    assert "restart" in results.summarize(runs)


def test_launch_rows_carry_the_first_line_the_fork_wait_and_the_agent_rss(bench) -> None:  # noqa: ANN001
    results = bench
    Run = results.Run
    runs = [Run("elasticrun", "launch", "ok", 3.0, first_line=1.0, fork_wait=0.02, agent_rss_mib=60.0),
            Run("elasticrun", "launch", "ok", 4.0, first_line=1.2, fork_wait=0.04, agent_rss_mib=62.0),
            Run("torchrun-default", "launch", "ok", 5.0, first_line=3.0, fork_wait=0.05, agent_rss_mib=250.0),
            Run("torchrun-best", "launch", "ok", 4.5, first_line=2.5, fork_wait=0.06, agent_rss_mib=240.0),
            Run("torchrun-best", "launch", "fail")]
    rows = {r["metric"]: r for r in results.summary_rows(runs, 2, 2, 60.0, "cmd")}
    first = rows["launch -> the script's first line, 1 x 2, --standalone"]
    assert first["elasticrun"] == 1.1 and first["alt_value"] == 2.5 and first["alternative"].startswith("torchrun-best")
    wait = rows["round formed -> the first worker's first line (first fork's wait), 1 x 2, --standalone"]
    assert wait["elasticrun"] == 0.03 and wait["alt_value"] == 0.05
    rss = rows["agent RSS while the workers run, 1 x 2, --standalone"]
    assert rss["elasticrun"] == 61.0 and rss["alt_value"] == 240.0 and rss["unit"] == "MiB"
    table = results.summarize(runs)
    assert "agent RSS MiB" in table and "| 61 |" in table


def test_round_formed_is_read_from_each_launchers_log(bench) -> None:  # noqa: ANN001
    bench_launch = bench
    lines = ["2026-11-27T18:12:20.804Z elasticrun[n]: round 0 (Start): world size 2, 1 node(s)",
             "[n/0]:bench-start t=1795803140.9000 rank=0"]
    assert bench_launch.round_formed(lines, "elasticrun") == pytest.approx(1795803140.804)
    assert bench_launch.first_line(lines) == pytest.approx(1795803140.9)
    torchrun = ["I1127 18:12:54.016000 10743 torch/distributed/elastic/agent/server/api.py:553] [default] "
                "Rendezvous complete for workers. Result:"]
    formed = bench_launch.round_formed(torchrun, "torchrun-default")
    local = time.localtime(formed)
    assert (local.tm_mon, local.tm_mday, local.tm_hour, local.tm_min, local.tm_sec) == (11, 27, 18, 12, 54)
    assert formed % 1 == pytest.approx(0.016, abs=1e-3)
    assert bench_launch.round_formed([], "elasticrun") is None
