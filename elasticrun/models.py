"""Old home of the shared data types, kept importable; they now live with their users:

- etcd records (NodeInfo, Member, Topology, RescaleEvent, RescaleType, WorkerStatus):
  :mod:`elasticrun.rendezvous.records`;
- training hints (AdaptationStrategy, RedistributionType): :mod:`elasticrun.job.hints`;
- TrainingState: :mod:`elasticrun.checkpoint.state`.
"""

from __future__ import annotations

from elasticrun.checkpoint.state import TrainingState
from elasticrun.job.hints import AdaptationStrategy, RedistributionType
from elasticrun.rendezvous.records import Member, NodeInfo, RescaleEvent, RescaleType, Topology, WorkerStatus

__all__ = [
    "AdaptationStrategy", "Member", "NodeInfo", "RedistributionType", "RescaleEvent", "RescaleType", "Topology",
    "TrainingState", "WorkerStatus",
]
