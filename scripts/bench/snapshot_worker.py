"""The training client of ``bench_snapshot.py --parts lost``: one checkpoint tier at one interval.

    elasticrun --standalone --nproc-per-node 2 scripts/bench/snapshot_worker.py --mode dcp --every N --dir DIR

Every rank holds ``--mb`` MiB of float32 state, changed every step, and meets the others in an all-reduce each
step; every ``--every`` steps it checkpoints to ``memory`` (``Snapshotter``), ``disk`` (``checkpoint.save`` to
DIR/ckpt) or ``dcp`` (DIR/dcp/step-<8 digits>), keeping 2, and resumes from the newest at start. Rank 0 prints
``start resumed <tier> <step> world <n>`` once per start and ``step S`` after each step; each rank writes its pid
to DIR/pids/<node id>-<local rank>. No checkpoint on stop: a failure loses what the interval leaves behind.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

import elasticrun.train as et
from elasticrun.checkpoint import Snapshotter, save


def resume(args: argparse.Namespace, state: Dict[str, torch.Tensor], pg: Any) -> Tuple[int, str]:
    """Load the newest checkpoint of ``--mode``'s tier into ``state``; its step and tier (0, "none": none)."""
    if args.mode == "dcp":
        import torch.distributed.checkpoint as dcp  # only here: its import would slow the other tiers' start

        done = os.listdir(args.dcp_root) if os.path.isdir(args.dcp_root) else []
        steps = [max((int(d[5:]) for d in done if os.path.exists(os.path.join(args.dcp_root, d, ".metadata"))),
                     default=-1)]
        dist.broadcast_object_list(steps, src=0, group=pg)  # every rank loads the step rank 0 found
        if steps[0] < 0:
            return 0, "none"
        dcp.load(state, checkpoint_id=os.path.join(args.dcp_root, f"step-{steps[0]:08d}"), process_group=pg)
        return steps[0], "dcp"
    ckpt = et.load_latest(args.disk_root, state_dict=state, process_group=pg, memory=args.mode == "memory",
                          restore_rng=False)  # into the tensors of ``state``
    if ckpt is None:
        return 0, "none"
    return ckpt.training_state.step if ckpt.training_state else 0, getattr(ckpt, "tier", "disk")


def checkpoint(args: argparse.Namespace, state: Dict[str, torch.Tensor], step: int, ctx: Any,
               snaps: Optional[Snapshotter]) -> None:
    """Checkpoint ``state`` at ``step`` to ``--mode``'s tier, keeping 2."""
    if snaps is not None:
        snaps.snapshot(state, training_state={"step": step})
    elif args.mode == "disk":
        save(state, args.disk_root, training_state={"step": step}, keep_last=2, process_group=ctx.cpu_process_group)
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=os.path.join(args.dcp_root, f"step-{step:08d}"),
                 process_group=ctx.cpu_process_group)
        if ctx.is_rank0:
            for name in sorted(os.listdir(args.dcp_root))[:-2]:
                shutil.rmtree(os.path.join(args.dcp_root, name), ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("memory", "disk", "dcp"), required=True)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--dir", required=True, help="checkpoint root (disk, dcp) and pid files")
    p.add_argument("--mb", type=float, default=4.0)
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    args.dcp_root, args.disk_root = os.path.join(args.dir, "dcp"), os.path.join(args.dir, "ckpt")
    ctx = et.init()
    pid_file = os.path.join(args.dir, "pids", f"{os.environ.get('ELASTICRUN_NODE_ID')}-{os.environ['LOCAL_RANK']}")
    os.makedirs(os.path.dirname(pid_file), exist_ok=True)
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    n = max(1, int(args.mb * (1 << 20) / 4 / 4))
    state = {f"t{i}": torch.zeros(n) for i in range(4)}
    step, tier = resume(args, state, ctx.cpu_process_group)
    if ctx.is_rank0:
        print(f"start resumed {tier} {step} world {ctx.world_size}", flush=True)
    snaps = Snapshotter(ctx.cpu_process_group) if args.mode == "memory" else None
    ones = torch.ones(1)
    try:
        while step < args.steps and not ctx.should_stop:
            for t in state.values():
                t.add_(1.0)
            dist.all_reduce(ones, group=ctx.cpu_process_group)  # the ranks meet every step
            time.sleep(args.step_sleep)
            step += 1
            if step % args.every == 0:
                checkpoint(args, state, step, ctx, snaps)
            if ctx.is_rank0:
                print(f"step {step}", flush=True)
        return 143 if ctx.should_stop else 0
    finally:
        if snaps is not None:
            snaps.close()
        ctx.close()


if __name__ == "__main__":
    sys.exit(main())
