"""When the bare fork server preloads: the decisions over /proc/stat samples, and the watch that acts on them
(fake samples and short sample times; the real server's preload is in tests/test_launch_forkserver.py)."""

from __future__ import annotations

import threading
import time
from typing import Iterator, List, Optional

import pytest

from elasticrun.launch import preload
from elasticrun.launch.preload import CpuTimes, PreloadWatch, due, idle_cores, parse_cpu_times, read_cpu_times

from helpers.procs import wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

STAT = """cpu  1126539 0 229296 211361 1493 0 3561 8347 0 0
cpu0 552303 0 114476 117517 480 0 1387 4075 0 0
intr 12345
"""


def test_cpu_times_are_idle_and_iowait_over_all_but_guest() -> None:
    assert parse_cpu_times(STAT) == (211361 + 1493, 1126539 + 229296 + 211361 + 1493 + 3561 + 8347)
    assert parse_cpu_times("intr 1\n") is None
    here = read_cpu_times()
    assert here is None or (0 <= here[0] <= here[1])
    assert read_cpu_times("/no/such/stat") is None


@pytest.mark.parametrize("before,after,cpus,want", [
    ((100, 1000), (150, 1100), 2, 1.0),  # half the time idle on 2 cores: one core's worth
    ((100, 1000), (100, 1100), 2, 0.0),  # all busy
    ((100, 1000), (300, 1200), 16, 16.0),  # all idle
    ((100, 1000), (100, 1000), 4, 0.0),  # no time passed
])
def test_idle_cores(before: CpuTimes, after: CpuTimes, cpus: int, want: float) -> None:
    assert idle_cores(before, after, cpus) == want


def test_preload_is_due_on_an_idle_core_or_at_the_latest() -> None:
    assert due(1.0, 0.0, latest_s=10.0) and due(3.5, 0.0, latest_s=10.0)
    assert not due(0.9, 9.9, latest_s=10.0)
    assert due(0.0, 10.0, latest_s=10.0)


def _samples(idle_per_sample: List[float], cpus: int = 2) -> Iterator[Optional[CpuTimes]]:
    """/proc/stat samples 100 jiffies apart whose idle share gives ``idle_per_sample`` cores, then busy."""
    idle, total = 0, 0
    yield idle, total
    for cores in idle_per_sample:
        total += 100
        idle += int(100 * cores / cpus)
        yield idle, total
    while True:
        total += 100
        yield idle, total


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preload, "SAMPLE_S", 0.01)


def _watch(samples: Iterator[Optional[CpuTimes]], cpus: int = 2) -> PreloadWatch:
    lock = threading.Lock()
    return PreloadWatch(lock, cpus=cpus, sample=lambda: next(samples))


def test_an_idle_core_orders_the_preload_once() -> None:
    orders: List[int] = []
    watch = _watch(_samples([0.0, 0.2, 1.5]))
    watch.start(lambda: orders.append(1), lambda: True)
    watch.start(lambda: orders.append(2), lambda: True)  # one watch at a time
    wait_until(lambda: orders, 10, "the preload order")
    assert orders == [1]


def test_a_busy_host_preloads_at_the_latest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preload, "LATEST_S", 0.3)
    orders: List[int] = []
    _watch(_samples([])).start(lambda: orders.append(1), lambda: True)
    wait_until(lambda: orders, 10, "the preload at the latest")


def test_a_changed_situation_ends_the_watch() -> None:
    """The round's workers stopped (or started) meanwhile; or the situation's own check fails."""
    released = threading.Event()
    orders: List[str] = []

    def samples() -> Iterator[Optional[CpuTimes]]:
        yield 0, 0
        released.wait(10)
        yield 100, 100  # idle: would order

    watch = _watch(samples())
    watch.start(lambda: orders.append("stale"), lambda: True)
    watch.changed()
    released.set()
    other = _watch(_samples([2.0]))
    other.start(lambda: orders.append("not wanted"), lambda: False)
    done = _watch(_samples([2.0]))
    done.start(lambda: orders.append("ok"), lambda: True)
    wait_until(lambda: orders, 10, "the last watch's order")
    assert orders == ["ok"]


def test_nothing_is_sampled_until_there_is_something_to_preload() -> None:
    """A script that never imported DDP's modules leaves the watch waiting: it reads no /proc/stat meanwhile."""
    calls: List[int] = []
    wanted = threading.Event()
    orders: List[int] = []
    source = _samples([1.5, 1.5])

    def sample() -> Optional[CpuTimes]:
        calls.append(1)
        return next(source)

    watch = PreloadWatch(threading.Lock(), cpus=2, sample=sample)
    watch.start(lambda: orders.append(1), lambda: True, wanted=wanted.is_set)
    wait_until(lambda: calls, 10, "the watch's first sample")
    time.sleep(0.2)  # twenty sampling periods while nothing is wanted
    assert calls == [1] and not orders
    wanted.set()
    wait_until(lambda: orders, 10, "the preload once it is wanted")
    assert orders == [1] and len(calls) >= 3
