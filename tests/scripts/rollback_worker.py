"""Test worker for the steps a rollback loses: ``rollback_worker.py OUT``. Restores with
``load_latest`` from OUT/ckpt, trains 0.05 s steps to step 50 reporting each with ``heartbeat``
after the step, saves every 10 steps; in round 0 it dies right after step 37 (no time for a
report to reach etcd). Truth: round 1 resumes from step 30, so 7 steps are redone."""

from __future__ import annotations

import os
import sys
import time

import torch

import elasticrun.train as et
from elasticrun.checkpoint import save

out = sys.argv[1]
root = os.path.join(out, "ckpt")
state = et.ElasticState.from_env()
model = {"w": torch.zeros(4)}
ckpt = et.load_latest(root, state_dict=model)
step = ckpt.training_state.step if ckpt is not None and ckpt.training_state is not None else 0
print(f"round {state.round} resumed at {step}", flush=True)
while step < 50:
    time.sleep(0.05)
    step += 1
    model["w"] += 1
    et.heartbeat(step)
    if step % 10 == 0:
        save(model, root, training_state={"step": step})
    if state.round == 0 and step == 37:
        os._exit(1)
