"""Test worker for the shutdown grace: reports steps with ``heartbeat``; in round 0, after step 5 it
writes OUT/saving (the time of its last step) and "saves" for SAVE_S seconds without reporting,
like a long checkpoint. A SIGTERM during the save lets the save finish (1 s more), then OUT/saved is
written and the worker exits 0. Later rounds print ``done rank=<RANK>`` at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import elasticrun.train as et

out = sys.argv[1]
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(time.monotonic()))


def main() -> None:
    if os.environ["ELASTICRUN_ROUND"] != "0":
        print(f"done rank={os.environ['RANK']}", flush=True)
        return
    for step in range(6):
        et.heartbeat(step)
        time.sleep(0.1)
    with open(os.path.join(out, "saving"), "w") as f:
        f.write(str(time.time()))
    deadline = time.monotonic() + float(os.environ.get("SAVE_S", "60"))
    while time.monotonic() < deadline and not stop:
        time.sleep(0.05)
    if stop:
        time.sleep(1.0)  # the rest of the save: longer than a hang's SIGKILL wait
    with open(os.path.join(out, "saved"), "w") as f:
        f.write("ok")


if __name__ == "__main__":
    main()
