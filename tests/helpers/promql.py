"""Prometheus' ``increase()`` and ``rate()`` over a list of scrapes, as Prometheus defines them.

The same arithmetic as ``extrapolatedRate`` in Prometheus' promql/functions.go (2.x): the samples
in the range ``[end - window, end]``; the difference between the last and the first, plus, at
every drop (a counter reset), the value before the drop; extrapolated to the range's edges when
the first/last sample lies within 1.1 average sample intervals of them (else by half an
interval), and never to before the counter's zero point. ``None`` with fewer than two samples
(Prometheus returns no value then).

So a counter that goes down is read as a reset to zero: a drop from 4.7 to 3.6 adds 3.6, not
-1.1 — what the agent's metrics must never make Prometheus do.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

Sample = Tuple[float, float]  # (time in seconds, value)


def in_range(samples: Sequence[Sample], end: float, window: float) -> List[Sample]:
    return [(t, v) for t, v in samples if end - window <= t <= end]


def increase(samples: Sequence[Sample], end: float, window: float) -> Optional[float]:
    """``increase(series[window])`` evaluated at time ``end``."""
    points = in_range(samples, end, window)
    if len(points) < 2:
        return None
    result = points[-1][1] - points[0][1]
    last = 0.0
    for _, value in points:
        if value < last:  # a reset: the counter started again from 0
            result += last
        last = value
    start = end - window
    to_start = points[0][0] - start
    to_end = end - points[-1][0]
    sampled = points[-1][0] - points[0][0]
    average = sampled / (len(points) - 1)
    if result > 0 and points[0][1] >= 0:
        to_zero = sampled * (points[0][1] / result)
        to_start = min(to_start, to_zero)
    threshold = average * 1.1
    extrapolated = sampled
    extrapolated += to_start if to_start < threshold else average / 2
    extrapolated += to_end if to_end < threshold else average / 2
    return result * (extrapolated / sampled)


def rate(samples: Sequence[Sample], end: float, window: float) -> Optional[float]:
    """``rate(series[window])`` evaluated at time ``end``: the increase per second of the window."""
    inc = increase(samples, end, window)
    return None if inc is None else inc / window


__all__ = ["Sample", "increase", "rate"]
