"""Cheap test worker (no torch): prints one line to stdout and one to stderr, tagged with its rank.

    stdout: ``echo-out rank=<RANK> restart=<RESTART> world=<WORLD_SIZE> args=<argv[1:]>``
    stderr: ``echo-err rank=<RANK> restart=<RESTART>``

Env knobs: ECHO_FAIL_RANK_AT_RESTART="rank:restart" makes that rank exit 3 (after printing);
ECHO_SLEEP_S keeps the worker alive that long first, ECHO_HOLD_FILE until that file exists (at most
300 s), and ECHO_PID_DIR gets ``<rank>.pid`` at start (for signal tests).
Runs as a script or as a module (``-m echo_worker`` with tests/scripts on PYTHONPATH).
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    rank = os.environ.get("RANK", "?")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
    world = os.environ.get("WORLD_SIZE", "?")
    pid_dir = os.environ.get("ECHO_PID_DIR")
    if pid_dir:
        with open(os.path.join(pid_dir, f"{rank}.pid.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.replace(os.path.join(pid_dir, f"{rank}.pid.tmp"), os.path.join(pid_dir, f"{rank}.pid"))
    time.sleep(float(os.environ.get("ECHO_SLEEP_S", "0")))
    hold = os.environ.get("ECHO_HOLD_FILE")
    deadline = time.monotonic() + 300
    while hold and not os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"echo-out rank={rank} restart={restart} world={world} args={sys.argv[1:]}", flush=True)
    print(f"echo-err rank={rank} restart={restart}", file=sys.stderr, flush=True)
    if os.environ.get("ECHO_FAIL_RANK_AT_RESTART") == f"{rank}:{restart}":
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
