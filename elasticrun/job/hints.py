"""Training hints the agent passes to workers (``ELASTICRUN_LR_SCALING``, ``ELASTICRUN_REDISTRIBUTION``).

Part of the job's contract: the CLI parses them, the agent writes their values, and
``elasticrun.train`` reads them. No torch here (the CLI imports this).
"""

from __future__ import annotations

import enum


class AdaptationStrategy(str, enum.Enum):
    """How the learning rate follows the world size."""

    LINEAR = "linear"
    SQUARE_ROOT = "sqrt"
    NONE = "none"


class RedistributionType(str, enum.Enum):
    """How data shards move when the world size changes."""

    FULL_RESHUFFLE = "full"
    INCREMENTAL = "incremental"


__all__ = ["AdaptationStrategy", "RedistributionType"]
