"""A worker with a known timeline, for the goodput ground-truth test (tests/test_launch_goodput_run.py).

``goodput_worker.py OUT STEPS STEP_S CKPT_EVERY STALL_S CRASH_AT``: one worker per job (rank 0).
Each step sleeps STEP_S; every CKPT_EVERY steps a "checkpoint" (a file with the step) blocks
STALL_S and is reported with ProgressReporter.stalled; in the first round the worker dies
(exit 1) right after step CRASH_AT; the next round restores the last checkpoint and goes on to
STEPS. Every event is appended to OUT/truth.jsonl with its time.time(): the ground truth.
"""

from __future__ import annotations

import json
import os
import sys
import time

import elasticrun.train as et

out, steps, step_s, ckpt_every, stall_s, crash_at = sys.argv[1], *map(float, sys.argv[2:7])
truth = open(os.path.join(out, "truth.jsonl"), "a", encoding="utf-8")
ckpt = os.path.join(out, "ckpt.txt")


def note(event: str, **kw: object) -> None:
    truth.write(json.dumps({"event": event, "time": time.time(), **kw}) + "\n")
    truth.flush()


state = et.ElasticState.from_env()
step = int(open(ckpt).read()) if os.path.exists(ckpt) else 0
progress = et.ProgressReporter(state)
progress.report(step)
note("start", step=step, round=state.round)
while step < steps:
    time.sleep(step_s)
    step += 1
    note("step", step=step)
    progress.report(step)
    if step % ckpt_every == 0:
        t0 = time.time()
        time.sleep(stall_s)
        with open(ckpt + ".tmp", "w") as f:
            f.write(str(step))
        os.replace(ckpt + ".tmp", ckpt)
        progress.stalled("checkpoint", time.time() - t0)
        note("stall", step=step, start=t0)
    if step == crash_at and state.restart_count == 0:
        note("crash", step=step)
        time.sleep(1.2)  # let the last report reach etcd (the reporter writes at most once a second)
        note("crashed", step=step)
        os._exit(1)
progress.close()
note("end", step=step)
