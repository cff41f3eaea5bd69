"""Where training is, saved in every checkpoint's metadata (:class:`TrainingState`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Dict


@dataclass
class TrainingState:
    """GlobalTrainingState: where training is, saved in every checkpoint."""

    epoch: int = 0
    step: int = 0
    samples_consumed: int = 0
    learning_rate: float = 0.0
    global_batch_size: int = 0
    world_size: int = 1
    timestamp: float = field(default_factory=time.time)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> TrainingState:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


__all__ = ["TrainingState"]
