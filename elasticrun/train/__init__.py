"""What a training script imports to be elastic.

    import elasticrun.train as et

    ctx = et.init()                                  # process group, device, SIGTERM flag
    sampler = et.ElasticDistributedSampler(dataset)  # resumes mid-epoch at any world size
    lr = et.scale_lr(base_lr, base_world, ctx.world_size, "linear")
    requests = et.CheckpointRequests(ctx)            # `elasticrun ckpt save` + agreed stop
    progress = et.ProgressReporter(ctx)              # progress in etcd for `elasticrun status`
    ckpt = et.load_latest(root)                      # newest loadable checkpoint, or None

See docs/training.md and examples/train.py.
"""

from elasticrun.models import AdaptationStrategy, DataShard, RedistributionType, RescaleType, TrainingState
from elasticrun.train.control import CheckpointRequests, StepDecision
from elasticrun.train.dist import ElasticContext, default_backend, init
from elasticrun.train.env import ElasticState
from elasticrun.train.lr import accumulation_steps, micro_batch_for, parse_strategy, scale_lr
from elasticrun.train.progress import ProgressReporter
from elasticrun.train.redistribution import DataRedistributionPlan, Transfer, make_shards
from elasticrun.train.resume import complete_checkpoints, load_latest
from elasticrun.train.sampler import ElasticDistributedSampler
from elasticrun.train.signals import GracefulStop

__all__ = [
    "AdaptationStrategy",
    "CheckpointRequests",
    "DataRedistributionPlan",
    "DataShard",
    "ElasticContext",
    "ElasticDistributedSampler",
    "ElasticState",
    "GracefulStop",
    "ProgressReporter",
    "RedistributionType",
    "RescaleType",
    "StepDecision",
    "TrainingState",
    "Transfer",
    "accumulation_steps",
    "complete_checkpoints",
    "default_backend",
    "init",
    "load_latest",
    "make_shards",
    "micro_batch_for",
    "parse_strategy",
    "scale_lr",
]
