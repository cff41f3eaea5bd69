"""What a training script imports to be elastic.

    import elasticrun.train as et

    ctx = et.init()                                  # process group, device, SIGTERM flag
    sampler = et.ElasticDistributedSampler(dataset)  # resumes mid-epoch at any world size
    lr = et.scale_lr(base_lr, base_world, ctx.world_size)   # the launcher's --lr-scaling
    requests = et.CheckpointRequests(ctx)            # `elasticrun ckpt save` + agreed stop
    progress = et.ProgressReporter(ctx)              # progress in etcd for `elasticrun status`
    inplace = et.InPlace(ctx, model=m, optimizer=o, sampler=sampler)  # in-place rescales
    et.heartbeat(step)                               # or just this, once per step (also --hang-timeout)
    timer = et.step_timer(ddp); with timer.step(): … # compute time per step: straggler detection
    ckpt = et.load_latest(root, sampler=sampler)     # newest checkpoint (+ sampler, RNG), or None
    state["rng"] = et.capture_rng(seed)              # every rank's generators, in the checkpoint

See docs/training.md and examples/train.py.

Importing it installs the commit fence's etcd read (:mod:`elasticrun.train.fence`): from then
on every checkpoint this process commits first checks that its round is still the job's.

Runs in the workers, beside the agent (never imported by it): may import
:mod:`elasticrun.checkpoint`, the rendezvous records, :mod:`elasticrun.store`,
:mod:`elasticrun.job`, ``errors`` and ``proc`` (see the package map in docs/design.md).
"""

from elasticrun.checkpoint.state import TrainingState
from elasticrun.job.hints import AdaptationStrategy, RedistributionType
from elasticrun.rendezvous.records import RescaleType
from elasticrun.train.control import CheckpointRequests, StepDecision
from elasticrun.train.dist import ElasticContext, default_backend, init
from elasticrun.train.env import ElasticState
from elasticrun.train.fence import install as _install_commit_fence
from elasticrun.train.inplace import InPlace, Reform, rebuild_ddp
from elasticrun.train.lr import (
    accumulation_steps,
    default_global_batch,
    default_strategy,
    micro_batch_for,
    parse_strategy,
    scale_lr,
    warmup_lr,
)
from elasticrun.train.progress import ProgressReporter, heartbeat
from elasticrun.train.resume import complete_checkpoints, load_latest
from elasticrun.train.rng import capture_rng, derive_seed, restore_rng, seed_all
from elasticrun.train.sampler import ElasticDistributedSampler, default_redistribution
from elasticrun.train.signals import GracefulStop
from elasticrun.train.steptime import StepTimer, step_timer

_install_commit_fence()

__all__ = [
    "AdaptationStrategy",
    "CheckpointRequests",
    "ElasticContext",
    "ElasticDistributedSampler",
    "ElasticState",
    "GracefulStop",
    "InPlace",
    "ProgressReporter",
    "RedistributionType",
    "Reform",
    "RescaleType",
    "StepDecision",
    "StepTimer",
    "TrainingState",
    "accumulation_steps",
    "capture_rng",
    "complete_checkpoints",
    "default_backend",
    "default_global_batch",
    "default_redistribution",
    "default_strategy",
    "derive_seed",
    "heartbeat",
    "init",
    "load_latest",
    "micro_batch_for",
    "parse_strategy",
    "rebuild_ddp",
    "restore_rng",
    "scale_lr",
    "seed_all",
    "step_timer",
    "warmup_lr",
]
