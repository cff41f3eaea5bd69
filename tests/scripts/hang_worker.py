"""Test worker for --hang-timeout (no process group): reports steps with ``elasticrun.train.heartbeat``,
then, in the first round only, stands in ``stuck_here`` for HANG_FOR seconds (default: for good).
Later rounds finish at once and print ``done rank=<RANK>``.
"""

from __future__ import annotations

import os
import time

import elasticrun.train as et


def stuck_here(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)


def main() -> None:
    for step in range(10):
        et.heartbeat(step)
        time.sleep(0.1)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        stuck_here(float(os.environ.get("HANG_FOR", "600")))
    print(f"done rank={os.environ['RANK']}", flush=True)


if __name__ == "__main__":
    main()
