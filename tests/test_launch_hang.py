"""--hang-timeout: a round whose reported step stops advancing is dumped (every worker's stacks) and
restarted under the restart budget. Real agent, etcd and worker processes; the watch's rule with a fake clock.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, List

import pytest

import elasticrun.launch.hang as hang_module
from elasticrun.cli.run_config import build_config
from elasticrun.errors import StoreError
from elasticrun.job.keys import JobKeys
from elasticrun.launch.failures import HangRole, hang_verdict
from elasticrun.launch.hang import HangWatch, skip_grace
from elasticrun.launch.stacks import collective_waited_in, last_dump, main_thread, user_view
from elasticrun.store.client import EtcdStore

from helpers.launch import SCRIPTS, run_cli

pytestmark = pytest.mark.integration  # starts etcd or processes

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
    assert _parse([], {}).health.hang_timeout == 0.0
    assert _parse([], {"ELASTICRUN_HANG_TIMEOUT": "45"}).health.hang_timeout == 45.0
    assert _parse(["--hang-timeout", "7.5"], {"ELASTICRUN_HANG_TIMEOUT": "45"}).health.hang_timeout == 7.5


def test_a_hung_round_shows_every_workers_stack_and_restarts() -> None:
    # --no-prewarm: fresh workers, the unmodified `python script.py` path; forked and pre-warmed ones get the
    # same bootstrap (warm.py's _become registers the stack dump for all three).
    proc = run_cli(["--standalone", "--node-id", "nodeH", "--nproc-per-node", "2", "--max-restarts", "1",
                    "--hang-timeout", "3", "--no-prewarm", WORKER], timeout=180)
    err = proc.stderr
    assert proc.returncode == 0, err
    for rank in (0, 1):  # faulthandler's frame line, with the worker's prefix: where each one stands
        assert re.search(rf"\[nodeH/{rank}\]:\s+File \".*hang_worker\.py\", line \d+ in stuck_here", err), err
    assert "no progress for 3 s; which rank stopped first cannot be told (no rank waits in a collective); " \
           "stacks above" in err, err
    assert "restarts 1/1" in err, err
    assert sorted(re.findall(r"done rank=(\d)", proc.stdout)) == ["0", "1"], proc.stdout


def test_without_hang_timeout_a_long_pause_is_left_alone() -> None:
    proc = run_cli(["--standalone", "--node-id", "nodeN", "--nproc-per-node", "1", "--max-restarts", "1", WORKER],
                   env={"HANG_FOR": "5"}, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "no progress" not in proc.stderr and "stuck_here" not in proc.stderr, proc.stderr
    assert "restarts 1/1" not in proc.stderr and "done rank=0" in proc.stdout


COLLECTIVE_WORKER = str(SCRIPTS / "hang_collective_worker.py")
SLOW_SAVE_WORKER = str(SCRIPTS / "slow_save_worker.py")


def _dump_of(code: str) -> bytes:
    """The stderr of a Python process that dumps its stacks with faulthandler (as a hung worker does)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert b"most recent call first" in proc.stderr, proc.stderr
    return proc.stderr


def test_a_dump_tells_a_rank_waiting_in_a_collective_from_one_stopped_elsewhere() -> None:
    # A real faulthandler dump: main thread in "stuck", a second thread of the script's, one of threading's.
    dump = _dump_of(
        "import faulthandler, threading, time, sys\n"
        "print('before the dump', file=sys.stderr)\n"
        "ev = threading.Event()\n"
        "def loader():\n    ev.wait()\n"
        "threading.Thread(target=loader, daemon=True).start()\n"
        "def stuck():\n    faulthandler.dump_traceback(all_threads=True)\n"
        "stuck()\n")
    threads = last_dump(dump)
    assert len(threads) == 2, threads
    main = main_thread(threads)
    assert main is not None and main.frames[0].name == "stuck" and main.is_main
    assert collective_waited_in(threads) is None
    assert "in loader" in user_view(threads) and user_view(threads).index("in stuck") < user_view(threads).index(
        "in loader"), "the main thread comes first"
    # The same stack as seen inside torch.distributed, below elasticrun's bootstrap and runpy.
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(hang_module.__file__)))
    text = (
        "Current thread 0x00007f00 (most recent call first):\n"
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper\n'
        '  File "/job/train.py", line 24 in train_step\n'
        '  File "/job/train.py", line 42 in <module>\n'
        f'  File "{pkg}/launch/warm.py", line 132 in _run_script\n'
        '  File "<frozen runpy>", line 88 in _run_code\n'
    )
    waiting = last_dump(b"[older output]\n" + text.encode())
    assert collective_waited_in(waiting) == "all_reduce"
    shown = user_view(waiting)
    assert "train_step" in shown and "all_reduce" in shown
    assert "warm.py" not in shown and "runpy" not in shown, shown


def test_the_verdict_names_the_rank_outside_the_collective_or_says_none_can_be_told() -> None:
    def row(node: str, rank: int, role: HangRole, where: str = "all_reduce") -> dict:
        msg = f"no progress for 5 s: waiting in {where}" if role is HangRole.WAITING else "no progress for 5 s: x"
        return {"node_id": node, "rank": rank, "local_rank": 0, "signal": role.value, "message": msg}

    # Across nodes: the waiting node's rows came first (it detected the hang first).
    rows = [row("a", 0, HangRole.WAITING), row("a", 1, HangRole.WAITING), row("b", 2, HangRole.STOPPED)]
    verdict = hang_verdict(rows)
    assert verdict is not None and [r["rank"] for r in verdict.first] == [2]
    assert [r["rank"] for r in verdict.rows] == [2, 0, 1]
    assert verdict.note == "rank 2 stopped first: not in a collective while ranks 0, 1 wait in all_reduce"
    every = hang_verdict([row("a", 0, HangRole.WAITING), row("a", 1, HangRole.WAITING, "barrier")])
    assert every is not None and not every.first and "cannot be told (every rank waits in a collective)" in every.note
    none = hang_verdict([row("a", 0, HangRole.STOPPED), row("a", 1, HangRole.STOPPED)])
    assert none is not None and not none.first and "cannot be told (no rank waits in a collective)" in none.note
    assert hang_verdict([{"node_id": "a", "rank": 0, "signal": None, "exitcode": 1}]) is None, "a crash: no verdict"


def test_a_hang_names_the_rank_that_stopped_first_and_shows_the_scripts_frames() -> None:
    """Rank 1 stands in its own code while rank 0 waits for it in all_reduce: the summary blames rank 1
    (not the first rank listed), and its stack shows the script's frames, not elasticrun's bootstrap."""
    proc = run_cli(["--standalone", "--node-id", "nodeS", "--nproc-per-node", "2", "--max-restarts", "0",
                    "--hang-timeout", "3", COLLECTIVE_WORKER], timeout=180)
    err = proc.stderr
    assert proc.returncode == 1, err
    assert "rank 1 stopped first: not in a collective while rank 0 waits in all_reduce" in err, err
    summary = err[err.index("job failed"):]
    rows = [ln for ln in summary.splitlines() if "(local " in ln]
    assert "nodeS (stopped first)" in rows[0] and "1 (local 1)" in rows[0] and " hung " in rows[0], summary
    assert "0 (local 0)" in rows[1] and " waiting " in rows[1] and "root cause" not in summary, summary
    assert "in stuck_here" in summary, summary
    assert "warm.py" not in summary and "runpy" not in summary and "progress.py" not in summary, summary
    assert "warm.py" not in err and "runpy" not in err, "the dumps in the log show the script's frames: " + err


def test_only_a_detected_hang_skips_the_shutdown_grace() -> None:
    assert skip_grace(9.0, 16.0, [{"signal": "hung"}, {"signal": "waiting"}])
    assert not skip_grace(9.0, 16.0, []), "a planned end (scale-up, leave) during a long save"
    assert not skip_grace(9.0, 16.0, [{"signal": None, "exitcode": 1}]), "another node's crash"
    assert not skip_grace(3.0, 16.0, [{"signal": "hung"}]), "our workers still advanced"


def test_a_long_healthy_save_gets_its_grace_when_a_planned_round_end_comes(
        tmp_path: Path, etcd: EtcdStore, etcd_server: Any, job_id: str, agents: Any) -> None:
    """The step has stood still for more than half --hang-timeout (a long save) when the round ends for a
    scale-up: the worker gets SIGTERM and its --shutdown-timeout, finishes the save and exits."""
    agent = agents(["--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id, "--nnodes", "1:2",
                    "--node-id", "nodeG", "--nproc-per-node", "1", "--max-restarts", "0", "--hang-timeout", "16",
                    "--shutdown-timeout", "20", SLOW_SAVE_WORKER, str(tmp_path)])
    saving = tmp_path / "saving"
    deadline = time.monotonic() + 120
    while not saving.exists() and agent.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert saving.exists(), agent.stderr()
    # The agent sees a step up to ~3 s late (reports at most once a second, read once a second): 12 s after
    # the last step it has seen the step stand still for 9-12 s, more than half the hang timeout, not all of it.
    last_step = float(saving.read_text())
    while time.time() < last_step + 12.0:
        time.sleep(0.1)
    etcd.create(JobKeys(job_id).end(0), json.dumps({"reason": "scale-up: test", "by": "test"}))
    assert agent.wait(120) == 0, agent.stderr()
    assert (tmp_path / "saved").exists(), "the save was cut short: " + agent.stderr()
    assert "dumping their Python stacks" not in agent.stderr() and "done rank=0" in agent.stdout()
