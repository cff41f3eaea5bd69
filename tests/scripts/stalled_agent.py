"""An elasticrun agent whose round loop stalls once (tests/test_launch_liveness.py).

usage: stalled_agent.py SECONDS [elasticrun arguments]

Runs ``elasticrun`` with the arguments; at the first turn of its first round, right before the
loop checks its lease, the agent's main thread sleeps SECONDS. The process runs on meanwhile,
its lease-refresh thread included (this is not SIGSTOP): only the lease's liveness gate, fed by
the loop's beats, can stop the refreshing.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's elasticrun

from elasticrun.cli.main import main  # noqa: E402
from elasticrun.launch.outage import OutageGuard  # noqa: E402

STALL_S = float(sys.argv.pop(1))
_check = OutageGuard.check
_stalled = []


def stalling_check(guard, topo):
    """The round loop's lease check, after one stall of STALL_S seconds the first time."""
    if not _stalled:
        _stalled.append(True)
        time.sleep(STALL_S)
    return _check(guard, topo)


OutageGuard.check = stalling_check

if __name__ == "__main__":
    main()
