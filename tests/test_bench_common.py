"""``scripts/bench/common.py``'s job runner ``Agents``: its end kills what a run started, even a process that
left the agents' tree, and its waits end on a deadline or when the agents are gone."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest

from helpers.procs import wait_until

pytestmark = pytest.mark.integration  # starts processes

BENCH = Path(__file__).resolve().parent.parent / "scripts" / "bench"
# An agent that starts a sleeper through a short-lived middle process: the sleeper is no longer below the agent.
ORPHANING = """
import subprocess, sys, time
sleeper = "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], " \
          "start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid, flush=True)"
mid = subprocess.run([sys.executable, "-c", sleeper], capture_output=True, text=True)
print(f"orphan {mid.stdout.strip()}", flush=True)
time.sleep(300)
"""


@pytest.fixture(scope="module")
def common():  # noqa: ANN201 - the bench module, imported as the benches import it
    sys.path.insert(0, str(BENCH))
    try:
        import common

        yield common
    finally:
        sys.path.remove(str(BENCH))


def _orphan_pid(text: str, _read_at: float):  # noqa: ANN202 - an Agents parse function
    return int(text.split()[1]) if text.startswith("orphan ") else None


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_close_kills_the_agents_and_a_process_that_left_their_tree(common, tmp_path: Path) -> None:  # noqa: ANN001
    agents = common.Agents(log_dir=tmp_path, parse=_orphan_pid)
    proc = agents.start("a", [sys.executable, "-c", ORPHANING])
    try:
        orphan = agents.wait_for(lambda: next(iter(agents.found()), None), 120, "the orphan's pid")
        assert orphan not in [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert psutil.Process(orphan).environ()[common.TAG_VAR] == agents.tag
    finally:
        agents.close()
    assert proc.returncode is not None
    wait_until(lambda: _gone(orphan), 30, "the orphan killed by its marker")
    assert f"orphan {orphan}" in (tmp_path / "a.log").read_text()


def test_waits_end_when_the_agents_exit_or_time_runs_out(common) -> None:  # noqa: ANN001
    agents = common.Agents()
    agents.start("quick", [sys.executable, "-c", "print('done', flush=True)"])
    try:
        with pytest.raises(common.AgentsExited, match="quick exit 0"):
            agents.wait_for(lambda: None, 120, "a line that never comes")
        assert [ln.text for ln in agents.lines("quick")] == ["done"]
    finally:
        agents.close()
    agents = common.Agents()
    agents.start("slow", [sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        with pytest.raises(TimeoutError, match="waited 1 s for a line that never comes"):
            agents.wait_for(lambda: None, 1, "a line that never comes")
        killed = agents.kill("slow")
        assert agents.procs["slow"].returncode is not None and killed > agents.started["slow"]
        assert not agents.running()  # killed on purpose: no agent is expected to run
    finally:
        agents.close()
