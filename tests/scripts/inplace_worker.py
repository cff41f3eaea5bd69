"""Test worker for in-place re-forming: a tiny model trained over an elastic sampler.

Appends one JSON line per step to ``$INPLACE_LOG`` (pid, rank, world, round, step, indices, time,
weights, backend, CUDA_VISIBLE_DEVICES). Trains on ``ctx.device``: the CPU under gloo, its GPU under
nccl. ``INPLACE_DDP=1``: gradients through DDP, rebuilt with ``et.rebuild_ddp`` after each re-form
(else an all-reduce per parameter on the default group).
``INPLACE_DIE=sync`` (newcomer: dies before receiving the state) or ``INPLACE_DIE=reform:STEP``
(survivor: dies inside the re-form after STEP) simulate failures. ``INPLACE_DATASET``: samples per
epoch (120); ``INPLACE_PACE``: seconds between steps, none once ``INPLACE_FAST_FILE`` exists.
``INPLACE_JOIN_TIMEOUT``: seconds to wait for the first group and for a re-formed one;
``INPLACE_REFORM_TIMEOUT`` (default: the same) for a re-formed one only; ``INPLACE_TIMEOUT``: InPlace's
``timeout`` (5).
``INPLACE_START_DELAY``: seconds to sleep before ``init`` (a slow newcomer: a long join window);
``INPLACE_START_GATE``: a file to wait for before ``init`` (``<gate>.waiting`` says it waits).
``INPLACE_CKPT_DIR`` + ``INPLACE_CKPT_EVERY``: save a checkpoint there every N steps (collective);
rank 0 logs ``{"saved": name}`` or ``{"refused": error}`` with its round.
``INPLACE_HEARTBEAT=1``: ``et.heartbeat(step)`` after every step; ``INPLACE_HANG_FILE``: once that
file exists, the worker stops making progress after its next step's line (sleeps in its loop: a hang;
``<file>.stuck`` says it does); ``INPLACE_CRASH_FILE``:
once that file exists, the worker exits 1 (a crash); ``INPLACE_CRASH_MID_FILE``: the same, between the
two gradient all-reduces of a step (without DDP). ``INPLACE_WATCH=1``: ``InPlace`` takes its NCCL path
over gloo (the abort watch, the optimizer step hook, the abort instead of the destroy-after-synchronize).
A step whose collective fails is handed to
``InPlace.recover``: a ``{"recovered": ...}`` line, then the step is redone in the re-formed group.
The restart path by hand: ``INPLACE_RESUME=PATH`` loads the state saved at ``PATH`` (if it exists),
``INPLACE_STOP_AFTER=STEP`` saves it there after STEP (rank 0) and exits 0.
``INPLACE_EXIT_DELAY``: seconds a worker told to stop (a graceful leave) waits before it exits (a slow exit).
"""

import json
import os
import time

import torch
import torch.distributed as dist

import elasticrun.train as et
from elasticrun.train import inplace

DATASET = int(os.environ.get("INPLACE_DATASET", "120"))
LOCAL_BATCH = 2

die = os.environ.get("INPLACE_DIE", "")
if die == "sync":
    real_sync = inplace.InPlace.sync
    inplace.InPlace.sync = lambda self: os._exit(3)  # noqa: ARG005 - dies mid-sync
if die.startswith("reform:"):
    at = int(die.split(":")[1])
    real_reform = inplace.InPlace._reform

    def _dying_reform(self):
        if self.step >= at:
            dist.destroy_process_group()
            os._exit(4)  # gone after leaving the old group, before joining the new one
        real_reform(self)

    inplace.InPlace._reform = _dying_reform

if os.environ.get("INPLACE_WATCH") == "1":  # the NCCL path's abort watch and optimizer hook, over gloo
    inplace.InPlace._nccl = property(lambda self: True)

time.sleep(float(os.environ.get("INPLACE_START_DELAY", "0")))
gate = os.environ.get("INPLACE_START_GATE", "")
if gate:
    open(gate + ".waiting", "w").close()
while gate and not os.path.exists(gate):
    time.sleep(0.02)
ctx = et.init(timeout=float(os.environ.get("INPLACE_JOIN_TIMEOUT", "40")))
torch.manual_seed(0)
model = torch.nn.Linear(4, 1).to(ctx.device)  # cpu (gloo) or this worker's GPU (nccl)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sampler = et.ElasticDistributedSampler(DATASET, seed=1)
reform = et.InPlace(ctx, timeout=float(os.environ.get("INPLACE_TIMEOUT", "5")),
                    join_timeout=float(os.environ.get("INPLACE_REFORM_TIMEOUT", os.environ.get(
                        "INPLACE_JOIN_TIMEOUT", "40"))),
                    model=model, optimizer=opt, sampler=sampler)
# DDP after InPlace: a newcomer's first collectives must be the re-form's (the state it receives).
ddp = torch.nn.parallel.DistributedDataParallel(model) if os.environ.get("INPLACE_DDP") == "1" else None
resume = os.environ.get("INPLACE_RESUME", "")
stop_after = int(os.environ.get("INPLACE_STOP_AFTER", "0"))
if resume and os.path.exists(resume):
    saved = torch.load(resume, map_location=ctx.device)
    for name, obj in (("model", model), ("opt", opt), ("sampler", sampler)):
        obj.load_state_dict(saved[name])
    reform.step = saved["step"]
g = torch.Generator().manual_seed(7)
X = torch.randn(DATASET, 4, generator=g).to(ctx.device)
Y = torch.randn(DATASET, 1, generator=g).to(ctx.device)
heartbeat = os.environ.get("INPLACE_HEARTBEAT") == "1"
hang = os.environ.get("INPLACE_HANG_FILE", "")
crash = os.environ.get("INPLACE_CRASH_FILE", "")
crash_mid = os.environ.get("INPLACE_CRASH_MID_FILE", "")
ckpt_dir = os.environ.get("INPLACE_CKPT_DIR", "")
ckpt_every = int(os.environ.get("INPLACE_CKPT_EVERY", "0")) if ckpt_dir else 0


def save_checkpoint(out) -> None:
    from elasticrun.checkpoint import save
    from elasticrun.errors import ElasticrunError

    row = {"pid": os.getpid(), "round": ctx.round, "at": reform.step}
    try:
        row["saved"] = save({"model": model.state_dict()}, ckpt_dir, f"step-{reform.step:08d}",
                            process_group=ctx.cpu_process_group)
    except ElasticrunError as err:
        row["refused"] = str(err)
    row["t"] = time.time()
    if ctx.rank == 0:
        out.write(json.dumps(row) + "\n")
        out.flush()


pace = float(os.environ.get("INPLACE_PACE", "0.05"))
fast = os.environ.get("INPLACE_FAST_FILE", "")  # once this file exists: no pause between steps
with open(os.environ["INPLACE_LOG"], "a") as log:
    while not sampler.epoch_done:
        idx = list(iter(sampler))[:LOCAL_BATCH]
        try:  # the step: its collectives may fail when a peer crashes
            loss = torch.nn.functional.mse_loss((ddp or model)(X[idx]), Y[idx])
            opt.zero_grad()
            loss.backward()
            if ddp is None:
                for i, p in enumerate(model.parameters()):
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
                    if i == 0 and crash_mid and os.path.exists(crash_mid):
                        os._exit(1)  # a crash between two collectives of a step
            opt.step()
        except RuntimeError as err:
            result = reform.recover(err)  # re-raises unless the agent recovers the crash in place
            log.write(json.dumps({"pid": os.getpid(), "recovered": result.value, "round": ctx.round,
                                  "at": reform.step, "pause": reform.last_pause_s}) + "\n")
            log.flush()
            if result is et.Reform.STOP:
                break
            if ddp is not None:
                ddp = et.rebuild_ddp(ddp)
            continue  # redo the interrupted step in the new group (nothing of it was applied)
        sampler.advance(LOCAL_BATCH)
        reform.step += 1
        log.write(json.dumps({"pid": os.getpid(), "rank": ctx.rank, "world": ctx.world_size, "round": ctx.round,
                              "step": reform.step, "idx": idx, "t": time.time(), "backend": ctx.backend,
                              "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
                              "w": model.weight.detach().flatten().tolist()}) + "\n")
        log.flush()
        if heartbeat:
            et.heartbeat(reform.step)
        if crash and os.path.exists(crash):
            os._exit(1)
        if hang and os.path.exists(hang):
            open(hang + ".stuck", "w").close()
        while hang and os.path.exists(hang):
            time.sleep(0.1)
        if ckpt_every and reform.step % ckpt_every == 0:
            save_checkpoint(log)
        if reform.step == stop_after:
            if ctx.rank == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sampler": sampler.state_dict(),
                            "step": reform.step}, resume)
            dist.barrier()
            break
        time.sleep(0.0 if fast and os.path.exists(fast) else pace)
        result = reform.check()
        if result is et.Reform.STOP:
            break
        if result is et.Reform.REFORMED:
            if ddp is not None:
                ddp = et.rebuild_ddp(ddp)
            log.write(json.dumps({"pid": os.getpid(), "reformed": reform.last_pause_s, "round": ctx.round}) + "\n")
            log.flush()
if not sampler.epoch_done:
    time.sleep(float(os.environ.get("INPLACE_EXIT_DELAY", "0")))
ctx.close()
