"""Learning rate and batch size as the world size changes (AdaptationStrategy).

With data parallelism the global batch is ``micro_batch * world_size * accumulation``.
When the world size changes, either the learning rate follows the global batch
(``Linear``: proportional, the Goyal et al. rule; ``SquareRoot``: proportional to the
square root, common with Adam) or it stays put (``None``), in which case the global
batch should stay put too: :func:`accumulation_steps` gives the gradient accumulation
that keeps it constant.
"""

from __future__ import annotations

import math
from typing import Union

from elasticrun.errors import ConfigError
from elasticrun.models import AdaptationStrategy

StrategyLike = Union[AdaptationStrategy, str, None]


def parse_strategy(strategy: StrategyLike) -> AdaptationStrategy:
    """Accept an :class:`AdaptationStrategy`, its value or name (``"linear"``, ``"SquareRoot"``,
    ``"sqrt"``, ``"none"``) or ``None`` (= ``AdaptationStrategy.NONE``)."""
    if strategy is None:
        return AdaptationStrategy.NONE
    if isinstance(strategy, AdaptationStrategy):
        return strategy
    key = str(strategy).strip().lower().replace("_", "").replace("-", "")
    aliases = {
        "linear": AdaptationStrategy.LINEAR,
        "sqrt": AdaptationStrategy.SQUARE_ROOT,
        "squareroot": AdaptationStrategy.SQUARE_ROOT,
        "none": AdaptationStrategy.NONE,
        "constant": AdaptationStrategy.NONE,
    }
    if key not in aliases:
        raise ConfigError(f"unknown LR adaptation strategy {strategy!r}: use linear, sqrt or none")
    return aliases[key]


def scale_lr(base_lr: float, base_world_size: int, world_size: int, strategy: StrategyLike) -> float:
    """The learning rate for ``world_size`` workers, given ``base_lr`` tuned at ``base_world_size``.

    >>> scale_lr(0.1, 4, 8, "linear")
    0.2
    >>> round(scale_lr(0.1, 4, 16, "sqrt"), 6)
    0.2
    >>> scale_lr(0.1, 4, 2, "none")
    0.1
    """
    if base_world_size < 1 or world_size < 1:
        raise ConfigError(
            f"world sizes must be at least 1 (base_world_size={base_world_size}, world_size={world_size})"
        )
    if not math.isfinite(base_lr) or base_lr < 0:
        raise ConfigError(f"base learning rate must be a finite number >= 0, got {base_lr}")
    mode = parse_strategy(strategy)
    ratio = world_size / base_world_size
    if mode is AdaptationStrategy.LINEAR:
        return base_lr * ratio
    if mode is AdaptationStrategy.SQUARE_ROOT:
        return base_lr * math.sqrt(ratio)
    return base_lr


def accumulation_steps(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Gradient accumulation steps so that ``micro_batch * world_size * steps == global_batch``.

    Raises :class:`ConfigError` saying which sizes would work when it does not divide.

    >>> accumulation_steps(64, 8, 4)
    2
    """
    if global_batch < 1 or micro_batch < 1 or world_size < 1:
        raise ConfigError(
            f"batch sizes and world size must be >= 1 (global_batch={global_batch}, "
            f"micro_batch={micro_batch}, world_size={world_size})"
        )
    per_step = micro_batch * world_size
    if per_step > global_batch:
        raise ConfigError(
            f"global batch {global_batch} is smaller than one step of {world_size} workers x micro batch "
            f"{micro_batch} = {per_step}: lower the micro batch to at most {global_batch // world_size or 1} "
            "or raise the global batch"
        )
    steps, rest = divmod(global_batch, per_step)
    if rest:
        fits = [m for m in range(1, micro_batch + 1) if global_batch % (m * world_size) == 0]
        hint = f"a micro batch of {fits[-1]}" if fits else f"a global batch divisible by {world_size}"
        raise ConfigError(
            f"global batch {global_batch} is not a multiple of world size {world_size} x micro batch "
            f"{micro_batch} = {per_step}: use {hint}, or a global batch of {steps * per_step} or "
            f"{(steps + 1) * per_step}"
        )
    return steps


def micro_batch_for(global_batch: int, world_size: int, accumulation: int = 1) -> int:
    """Per-worker batch that keeps ``global_batch`` at ``world_size`` with ``accumulation`` steps.

    Raises :class:`ConfigError` when it does not divide.
    """
    if global_batch < 1 or world_size < 1 or accumulation < 1:
        raise ConfigError("global batch, world size and accumulation must all be >= 1")
    per, rest = divmod(global_batch, world_size * accumulation)
    if rest or per == 0:
        raise ConfigError(
            f"global batch {global_batch} cannot be split evenly over {world_size} workers x "
            f"{accumulation} accumulation steps"
        )
    return per


__all__ = ["StrategyLike", "accumulation_steps", "micro_batch_for", "parse_strategy", "scale_lr"]
