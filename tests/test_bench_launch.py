"""``scripts/bench/bench_launch.py``: the commands it runs and the JSON summary of its restart scenario."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "scripts" / "bench"


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201 - the bench modules, imported as the script imports them
    sys.path.insert(0, str(BENCH))
    try:
        import bench_launch
        import launch_results

        yield bench_launch, launch_results
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("launcher", ["elasticrun", "torchrun-default", "torchrun-best"])
def test_one_node_commands_allow_a_restart(bench, launcher: str) -> None:  # noqa: ANN001
    bench_launch, _ = bench
    (cmd,) = bench_launch._commands(launcher, 1, 2, "", "job")
    assert "--standalone" in cmd
    assert cmd[cmd.index("--max-restarts") + 1] == "3", "the restart scenario crashes a worker once"


def test_restart_summary_has_a_row_per_crash_moment(bench) -> None:  # noqa: ANN001
    _, results = bench
    Run = results.Run
    runs = [Run("elasticrun", "restart", "ok", 0.5), Run("elasticrun", "restart", "ok", 0.7),
            Run("torchrun-default", "restart", "ok", 6.0), Run("torchrun-best", "restart", "fail"),
            Run("elasticrun", "restart", "ok", 0.4, crash_after=1.0),
            Run("torchrun-default", "restart", "hang", crash_after=1.0),
            Run("elasticrun", "launch", "ok", 3.0)]
    rows = results.restart_summary(runs, 2, 1, 60.0, "cmd")
    assert [r["metric"] for r in rows] == ["worker crash (step 3 into the round) -> first step, 1 x 2",
                                           "worker crash (1s into the round) -> first step, 1 x 2"]
    assert rows[0]["elasticrun"] == 0.6 and rows[0]["alt_value"] == 6.0 and rows[0]["ratio"] == 10.0
    assert rows[0]["alternative"] == "torchrun-default (1/1 ok)"
    assert rows[1]["alt_value"] == 60.0 and "timeout as lower bound" in rows[1]["alternative"]
    assert "restart" in results.summarize(runs)
