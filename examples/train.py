"""A small but real elastic training job: an MLP fit to synthetic data with DDP.

Run it any of these ways (CPU/gloo; a GPU node uses nccl)::

    python examples/train.py --epochs 2                                   # one process
    torchrun --nproc-per-node 2 examples/train.py --epochs 2              # plain torchrun
    elasticrun --standalone --nproc-per-node 2 examples/train.py --epochs 2

What makes it elastic (see docs/training.md):

- it resumes from the newest checkpoint under ``--ckpt-dir`` at whatever world size it
  now has: model, optimizer, step, and the sampler's position in the epoch (no sample of
  the epoch is lost or repeated across a rescale);
- the learning rate follows the world size by the launcher's rule (``elasticrun
  --lr-scaling``, optionally ramped over ``--warmup-steps`` after a scale-up), or the
  global batch is kept constant with gradient accumulation (``elasticrun
  --global-batch-size`` or ``--global-batch``), with the LR then left alone;
- the checkpoint holds every rank's RNG state (torch, CUDA, ``random``, numpy), restored
  by ``load_latest`` together with the sampler;
- it re-forms in place (``et.InPlace``): at a planned rescale (a node joins, a node leaves
  gracefully) the survivors keep their processes, model and optimizer and go on at the new
  world size with the LR and accumulation of that size and the sampler's rest of the epoch;
  a newcomer receives the state from the survivors instead of loading a checkpoint
  (``--no-inplace``, or the launcher's ``--no-inplace``: every rescale restarts as below);
  when another node's worker crashes, the survivors leave the broken all-reduce, re-form with
  its replacement (``InPlace.recover``) and redo the interrupted step;
- on SIGTERM (the agent stopping workers for a rescale) every rank agrees to stop at the
  same step, saves a checkpoint and exits (code 143, "terminated"); in place, a node that
  leaves alone stops without a save (the survivors hold the state), and nodes signalled up to
  2 s apart still stop together and save;
- it answers ``elasticrun ckpt save`` requests and reports progress (and each rank's compute time per
  step, for straggler detection) for ``elasticrun status``.

Rank 0 prints one ``step N loss X world W`` line per step and ends with
``done: steps=N world=W final_loss=X``. With ``--metrics-log FILE`` it also appends one
JSON line per step (time, step, epoch, round, world size, lr, global batch, loss,
samples/s) that ``scripts/perf/plot_job.py metrics`` draws.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

import elasticrun.train as et
from elasticrun.errors import ConfigError, ElasticrunError

EXIT_STOPPED = 143  # like a process terminated by SIGTERM: the job is not finished


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="stop after this many global steps (0: no limit)")
    p.add_argument("--dataset-size", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32, help="per-worker micro batch")
    p.add_argument("--global-batch", type=int, default=et.default_global_batch(),
                   help="keep this global batch at any world size via gradient accumulation (LR then stays put) "
                        "[default: the launcher's --global-batch-size]")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate at --base-world-size workers "
                   "(scaled by the launcher's --lr-scaling)")
    p.add_argument("--base-world-size", type=int, default=1)
    p.add_argument("--warmup-steps", type=int, default=0, help="after a scale-up, ramp the LR up over this many steps")
    p.add_argument("--metrics-log", default="", help="rank 0 appends one JSON line per step to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=32, help="hidden width of the MLP: 18*H parameters, twice that "
                   "in a checkpoint with SGD's momentum (H=2800000: about 0.4 GB)")
    p.add_argument("--ckpt-dir", default=os.environ.get(et.env.ENV_CHECKPOINT_DIR) or "./ckpts")
    p.add_argument("--ckpt-every", type=int, default=50, help="checkpoint every N steps (0: only on stop/request/end)")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="memory snapshot every N steps into the agent's shared memory (0: off)")
    p.add_argument("--persist-every", type=int, default=0,
                   help="also copy every K-th memory snapshot to --ckpt-dir in the background (0: never)")
    p.add_argument("--async-snapshots", action="store_true", help="write memory snapshots on a background thread")
    p.add_argument("--no-checkpoint", action="store_true", help="never save or load checkpoints")
    p.add_argument("--step-sleep", type=float, default=0.0, help="sleep this long every step (seconds)")
    p.add_argument("--compute-sleep", type=float, default=os.environ.get("TRAIN_COMPUTE_SLEEP") or "0",
                   help="also sleep this long inside every step's compute, as a slower device would take (seconds; "
                   "default: $TRAIN_COMPUTE_SLEEP, so that one node's environment can make that node slow)")
    p.add_argument("--agree-every", default="auto",
                   help="steps between the ranks' stop/checkpoint-request agreement, or 'auto' (about every 0.2 s)")
    p.add_argument("--backend", default=None, help="process group backend (default: nccl on GPU, else gloo)")
    p.add_argument("--no-inplace", action="store_true",
                   help="never re-form in place: every rescale restarts the workers from a checkpoint")
    args = p.parse_args(argv)
    for flag in ("step_sleep", "compute_sleep"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag):g} is negative: give seconds >= 0")
    return args


def make_data(n: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Deterministic regression data: y = tanh(x . w) + noise, identical on every rank."""
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def log0(ctx: et.ElasticContext, msg: str) -> None:
    if ctx.is_rank0:
        print(msg, flush=True)


@record  # a failing rank's exception and traceback reach the launcher's root-cause table
def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    ctx = et.init(backend=args.backend)
    world = ctx.world_size
    torch.manual_seed(args.seed)
    x_all, y_all = make_data(args.dataset_size, args.seed)
    x_all, y_all = x_all.to(ctx.device), y_all.to(ctx.device)
    model = nn.Sequential(nn.Linear(16, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1)).to(ctx.device)

    if args.global_batch:
        accum = et.accumulation_steps(args.global_batch, args.batch_size, world)
        lr = args.lr  # constant global batch: constant learning rate
    else:
        accum = 1
        lr = et.scale_lr(args.lr, args.base_world_size, world)  # the launcher's --lr-scaling
    global_batch = args.batch_size * world * accum
    optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sampler = et.ElasticDistributedSampler(args.dataset_size, world, ctx.rank, seed=args.seed)

    step, resumed, loss_value, tier = 0, "nothing", float("nan"), "disk"
    # Before any other collective (a newcomer's first collectives are the survivors' re-form).
    reform = None if args.no_inplace else et.InPlace(ctx, model=model, optimizer=optim, sampler=sampler)
    inplace = reform is not None and reform.enabled
    if reform is not None and reform.joined:  # a newcomer: the survivors' model, optimizer, sampler and step
        step, loss_value = reform.step, float(reform.extra.get("loss", float("nan")))
        resumed = f"the survivors' state (in place) at step {step}"
    elif not args.no_checkpoint:
        # model/optimizer below; the sampler position and every rank's RNG state in the same call
        ckpt = et.load_latest(args.ckpt_dir, process_group=ctx.cpu_process_group, sampler=sampler)
        if ckpt is not None:
            model.load_state_dict(ckpt.state_dict["model"])
            optim.load_state_dict(ckpt.state_dict["optim"])
            step = ckpt.training_state.step if ckpt.training_state else 0
            loss_value = float(ckpt.state_dict.get("loss", float("nan")))
            tier = getattr(ckpt, "tier", "disk")  # "memory": a snapshot in the agent's shared memory
            resumed = f"{ckpt.name} (saved at world {ckpt.world_size}) tier {tier}"
    target_lr, resume_step = lr, step
    prev_world = ctx.state.prev_world_size
    prev_lr = (et.scale_lr(args.lr, args.base_world_size, prev_world) if prev_world and not args.global_batch
               else lr)

    def lr_at(step_now: int) -> float:
        """The LR for the next step: ramped from the old world's LR after a scale-up (--warmup-steps)."""
        return et.warmup_lr(target_lr, prev_lr, step_now - resume_step, args.warmup_steps)

    lr = lr_at(step)
    for group in optim.param_groups:
        group["lr"] = lr  # the saved LR was scaled for the old world size
    log0(ctx, f"start: {ctx.state.describe()} resumed {resumed} step {step} epoch {sampler.epoch} "
              f"lr {lr:.4g} global_batch {global_batch} accumulation {accum} "
              f"redistribution {sampler.redistribution.value}")
    metrics = open(args.metrics_log, "a", encoding="utf-8") if args.metrics_log and ctx.is_rank0 else None

    ddp = DDP(model) if ctx.distributed else model
    # Each rank's compute time per step (up to handing its gradients to the all-reduce), reported with the
    # progress: the launcher flags a rank much slower than the others (--straggler-threshold).
    timer = et.step_timer(ddp if isinstance(ddp, DDP) else None)
    every = args.agree_every if args.agree_every == "auto" else int(args.agree_every)
    requests = et.CheckpointRequests(ctx, every=every)
    progress = et.ProgressReporter(ctx)
    last_saved = step if resumed != "nothing" and tier == "disk" else -1  # memory dies with the job: save at the end
    samples_seen = 0
    progress.report(step)  # the round starts training here (the agent's goodput clock), at the step restored

    def state_now() -> Tuple[Any, Dict[str, Any]]:
        ts = et.TrainingState(epoch=sampler.epoch, step=step, samples_consumed=sampler.samples_consumed,
                              learning_rate=lr, global_batch_size=global_batch, world_size=world)
        state: Dict[str, Any] = {"model": model.state_dict(), "optim": optim.state_dict(),
                                 "sampler": sampler.state_dict(), "loss": loss_value,
                                 "rng": et.capture_rng(args.seed, ctx.cpu_process_group)}
        return ts, state

    def snapshotter() -> Any:
        """Memory snapshots on the current process group (a new one after each in-place re-form)."""
        from elasticrun.checkpoint import Snapshotter

        return Snapshotter(ctx.cpu_process_group, persist_to=args.ckpt_dir, persist_every=args.persist_every,
                           persist_keep_last=args.keep_last or None, async_snapshots=args.async_snapshots)

    snaps = snapshotter() if args.snapshot_every and not args.no_checkpoint else None

    def snapshot() -> None:
        nonlocal snaps
        from elasticrun.checkpoint import SnapshotUnavailable

        ts, state = state_now()
        t0 = time.perf_counter()
        try:
            snaps.snapshot(state, training_state=ts)
            progress.stalled("snapshot", time.perf_counter() - t0)
        except SnapshotUnavailable as err:  # deterministic: say it once, go on with disk checkpoints only
            log0(ctx, f"memory snapshots disabled: {err}")
            snaps = None
        except ElasticrunError as err:
            log0(ctx, f"memory snapshot failed: {err}")

    def save(reason: str) -> Optional[str]:
        nonlocal last_saved
        if args.no_checkpoint:
            return None
        from elasticrun.checkpoint import save as ckpt_save

        ts, state = state_now()
        t0 = time.perf_counter()
        name = ckpt_save(state, args.ckpt_dir, training_state=ts, keep_last=args.keep_last or None,
                         user_metadata={"example": "train.py", "reason": reason},
                         process_group=ctx.cpu_process_group)
        last_saved = step
        progress.stalled("checkpoint", time.perf_counter() - t0)
        log0(ctx, f"checkpoint {name} saved in {time.perf_counter() - t0:.2f}s ({reason})")
        return name

    def reformed() -> None:
        """In place at a new world size: the LR rule or the accumulation of that size, DDP on the new group."""
        nonlocal world, accum, lr, target_lr, prev_lr, resume_step, global_batch, ddp, step, snaps
        prev_lr, world = lr, ctx.world_size
        step = reform.step  # rank 0's: after a crash, a rank that finished the interrupted step takes it back
        if args.global_batch:
            accum = et.accumulation_steps(args.global_batch, args.batch_size, world)
        else:
            target_lr = et.scale_lr(args.lr, args.base_world_size, world)
        resume_step, global_batch = step, args.batch_size * world * accum
        lr = lr_at(step)
        for group in optim.param_groups:
            group["lr"] = lr
        if isinstance(ddp, DDP):
            ddp = et.rebuild_ddp(ddp)
            et.step_timer(ddp)  # the compute timer watches the new wrapper's gradient buckets
        # Agree at the same steps as a newcomer, on the new group; the new rank 0 answers requests.
        requests.regroup(ctx.cpu_process_group, rank=ctx.state.rank)
        if snaps is not None:  # its collectives ran on the old group: a newcomer's snapshots would wait forever
            with contextlib.suppress(ElasticrunError):
                snaps.close()
            snaps = snapshotter()
        log0(ctx, f"re-formed in place: {ctx.state.describe()} step {step} lr {lr:.4g} global_batch "
                  f"{global_batch} accumulation {accum} pause {reform.last_pause_s:.3f}s")

    def checkpoint(decision: Any) -> None:
        """Save for ``decision`` (a stop, a request, or the periodic one) and answer its requests."""
        reason = "stop" if decision.stop else "request" if decision.request_ids else "periodic"
        try:
            name = save(reason)
        except ElasticrunError as err:
            log0(ctx, f"checkpoint failed: {err}")
            for rid in decision.request_ids:
                requests.fail(rid, str(err))
            return
        for rid in decision.request_ids:
            if name is None:
                requests.fail(rid, "checkpointing is disabled (--no-checkpoint)")
            else:
                requests.done(rid, name, os.path.abspath(args.ckpt_dir), step)

    def recovered(err: RuntimeError) -> bool:
        """A collective failed (a peer crashed): True once re-formed in place with the crashed rank's
        replacement (``InPlace.recover``); False: stop (SIGTERM while waiting). Re-raises ``err`` when
        the launcher does not recover in place (not opted in, or it takes the restart path)."""
        if reform is None:
            raise err
        if reform.recover(err) is not et.Reform.REFORMED:
            return False
        reformed()
        return True

    stopped = finished = False
    t_start = t_last = time.perf_counter()
    try:
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)
            mine, start = sampler.indices(), 0
            while start < len(mine):
                if args.steps and step >= args.steps:
                    finished = True
                    break
                per_step = args.batch_size * accum
                chunk = mine[start : start + per_step]
                start += per_step
                if args.warmup_steps and lr != target_lr:
                    lr = lr_at(step)
                    for group in optim.param_groups:
                        group["lr"] = lr
                micro = [chunk[i : i + args.batch_size] for i in range(0, len(chunk), args.batch_size)]
                timer.begin()
                optim.zero_grad(set_to_none=True)  # first: a step redone after a crash drops its gradients
                if args.compute_sleep:
                    time.sleep(args.compute_sleep)
                total = 0.0
                try:
                    for j, mb in enumerate(micro):
                        sync = j == len(micro) - 1 or not isinstance(ddp, DDP)
                        with contextlib.nullcontext() if sync else ddp.no_sync():
                            loss = F.mse_loss(ddp(x_all[mb]), y_all[mb]) / len(micro)
                            loss.backward()
                        total += float(loss.detach())
                except RuntimeError as err:  # a peer crashed in the all-reduce: redo the step in place
                    if not recovered(err):
                        stopped = True
                        break
                    mine, start = sampler.indices(), 0  # the unfinished chunk is dealt again
                    continue
                optim.step()
                timer.end()
                step += 1
                sampler.advance(len(chunk))
                if reform is not None:
                    reform.step, reform.extra = step, {"loss": total}  # what a re-form hands on
                samples_seen += len(chunk) * world
                loss_value = total
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                log0(ctx, f"step {step} loss {loss_value:.6f} world {world}")
                if metrics is not None:
                    now = time.perf_counter()
                    metrics.write(json.dumps({
                        "time": time.time(), "step": step, "epoch": epoch, "round": ctx.state.round, "world": world,
                        "lr": lr, "global_batch": global_batch, "loss": loss_value,
                        "samples_per_s": len(chunk) * world / max(now - t_last, 1e-9)}) + "\n")
                    metrics.flush()
                    t_last = now
                progress.report(step, loss_value, samples=samples_seen)
                # In place, a stop is agreed by reform.check() (only the leaving ranks stop).
                try:
                    decision = requests.poll(step, stop=ctx.should_stop and not inplace)
                except RuntimeError as err:  # a peer crashed: this step is done, go on after re-forming
                    if not recovered(err):
                        stopped = True
                        break
                    mine, start = sampler.indices(), 0
                    continue
                try:
                    if snaps is not None and (step % args.snapshot_every == 0 or decision.stop):
                        snapshot()  # also at a stop (a rescale): the next round resumes from memory at this step
                    if decision.checkpoint or (args.ckpt_every and step % args.ckpt_every == 0):
                        checkpoint(decision)
                except RuntimeError as err:  # a peer crashed in their collectives (the RNG's gather): as above
                    if not recovered(err):
                        stopped = True
                        break
                    mine, start = sampler.indices(), 0
                    continue
                if decision.stop:
                    stopped = True
                    break
                if inplace:
                    result = reform.check()
                    if result is et.Reform.STOP:
                        if reform.group_kept:  # every rank stops here: save as the restart path does
                            save("stop")
                        stopped = True
                        break
                    if result is et.Reform.REFORMED:
                        reformed()
                        mine, start = sampler.indices(), 0  # this rank's rest of the epoch at the new world
            if stopped or finished:
                break
        if stopped:
            log0(ctx, f"stopped: {ctx.stop.signal_name or 'stop'} at step {step} world {world}")
            return EXIT_STOPPED
        if last_saved != step:
            save("final")
        if resumed != "nothing" and step == resume_step:
            log0(ctx, f"nothing to train: resumed {resumed} at step {step}, the end of a finished run "
                      f"(--epochs {args.epochs}{f', --steps {args.steps}' if args.steps else ''}); to train again "
                      f"use another --ckpt-dir (or delete {args.ckpt_dir}), to train on raise --epochs")
        log0(ctx, f"done: steps={step} world={world} final_loss={loss_value:.6f}")
        if os.environ.get("ELASTICRUN_EXAMPLE_TIMING"):
            log0(ctx, f"timing: {time.perf_counter() - t_start:.3f}s agreements={requests.agreements} "
                      f"agreement_ms={requests.mean_agreement_ms:.3f}")
        return 0
    finally:
        if snaps is not None:
            with contextlib.suppress(ElasticrunError):
                snaps.close()
        if metrics is not None:
            metrics.close()
        requests.close()
        progress.close()
        ctx.close()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as err:  # e.g. a global batch the world size does not divide: one line, no traceback
        print(f"train.py: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
