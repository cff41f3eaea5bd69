"""Learning rate and batch size as the world size changes (AdaptationStrategy).

With data parallelism the global batch is ``micro_batch * world_size * accumulation``.
When the world size changes, either the learning rate follows the global batch
(``Linear``: proportional, the Goyal et al. rule; ``SquareRoot``: proportional to the
square root, common with Adam) or it stays put (``None``), in which case the global
batch should stay put too: :func:`accumulation_steps` gives the gradient accumulation
that keeps it constant.

The launcher is the one place to set the rules: ``elasticrun --lr-scaling`` and
``--global-batch-size`` reach workers as ``ELASTICRUN_LR_SCALING`` and
``ELASTICRUN_GLOBAL_BATCH_SIZE``; :func:`scale_lr` without a strategy and
:func:`default_global_batch` read them. After a scale-up, :func:`warmup_lr` ramps the LR
from the old world size's value to the new one over K steps.
"""

from __future__ import annotations

import math
import os
from typing import Mapping, Optional, Union

from elasticrun.errors import ConfigError
from elasticrun.job import env as names
from elasticrun.job.hints import AdaptationStrategy

StrategyLike = Union[AdaptationStrategy, str, None]


class _FromLauncher:
    """Sentinel: "the strategy the launcher was given" (``ELASTICRUN_LR_SCALING``)."""

    def __repr__(self) -> str:
        return "FROM_LAUNCHER"


FROM_LAUNCHER = _FromLauncher()
DEFAULT_STRATEGY = AdaptationStrategy.LINEAR  # elasticrun's --lr-scaling default


def default_strategy(env: Optional[Mapping[str, str]] = None) -> AdaptationStrategy:
    """The launcher's ``--lr-scaling`` (``ELASTICRUN_LR_SCALING``); ``linear`` (the launcher's
    default) when the script was not started by elasticrun."""
    env = os.environ if env is None else env
    raw = env.get(names.LR_SCALING, "").strip()
    if not raw:
        return DEFAULT_STRATEGY
    try:
        return parse_strategy(raw)
    except ConfigError:
        raise ConfigError(f"{names.LR_SCALING}={raw!r} is not linear, sqrt or none") from None


def default_global_batch(env: Optional[Mapping[str, str]] = None) -> int:
    """The launcher's ``--global-batch-size`` (``ELASTICRUN_GLOBAL_BATCH_SIZE``), 0 when unset."""
    env = os.environ if env is None else env
    raw = env.get(names.GLOBAL_BATCH_SIZE, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{names.GLOBAL_BATCH_SIZE}={raw!r} must be a whole number >= 0")
    return value


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


def scale_lr(
    base_lr: float,
    base_world_size: int,
    world_size: int,
    strategy: Union[StrategyLike, _FromLauncher] = FROM_LAUNCHER,
) -> float:
    """The learning rate for ``world_size`` workers, given ``base_lr`` tuned at ``base_world_size``.

    Without ``strategy`` the launcher's ``--lr-scaling`` applies (:func:`default_strategy`);
    ``None`` means no scaling.

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
    mode = default_strategy() if isinstance(strategy, _FromLauncher) else parse_strategy(strategy)
    ratio = world_size / base_world_size
    if mode is AdaptationStrategy.LINEAR:
        return base_lr * ratio
    if mode is AdaptationStrategy.SQUARE_ROOT:
        return base_lr * math.sqrt(ratio)
    return base_lr


def warmup_lr(target_lr: float, prev_lr: float, steps_since_rescale: int, warmup_steps: int) -> float:
    """The LR for the ``steps_since_rescale``-th step (0-based) after a rescale: a linear ramp
    from ``prev_lr`` (the old world size's LR) that reaches ``target_lr`` after ``warmup_steps``
    steps. Only increases are ramped (after a scale-up); a lower target applies at once.

    >>> [round(warmup_lr(0.4, 0.2, s, 4), 3) for s in range(5)]
    [0.25, 0.3, 0.35, 0.4, 0.4]
    """
    if warmup_steps < 0 or steps_since_rescale < 0:
        raise ConfigError(f"warmup steps must be >= 0 (warmup_steps={warmup_steps}, step={steps_since_rescale})")
    if warmup_steps == 0 or target_lr <= prev_lr or steps_since_rescale >= warmup_steps:
        return target_lr
    return prev_lr + (target_lr - prev_lr) * (steps_since_rescale + 1) / warmup_steps


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


__all__ = [
    "FROM_LAUNCHER",
    "StrategyLike",
    "accumulation_steps",
    "default_global_batch",
    "default_strategy",
    "micro_batch_for",
    "parse_strategy",
    "scale_lr",
    "warmup_lr",
]
