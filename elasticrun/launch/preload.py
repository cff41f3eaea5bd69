"""When the fork server preloads torch (and DDP's extras, for a script that uses them): once the host
has a core to spare.

The fork server starts bare (:mod:`elasticrun.launch.zygote`), so the first round's workers start as
fast as torchrun's and import what their script imports. Its preload (torch and DDP's first-use
modules, ~3 CPU-s) makes every later round's workers skip those imports; it must not take the CPU
from the workers while they start, on a machine with few cores. So :class:`PreloadWatch` orders it
once the host has had at least one core idle over a short sample (:func:`idle_cores`, from
``/proc/stat``), or at the latest :data:`LATEST_S` after it began watching: a host whose workers
keep every core busy (CPU training) still gets fast restarts, the preload then competing once for a
few seconds. On a GPU host the cores are idle while the workers wait on their GPUs: the preload
starts at once.

The agent watches in two situations: while a round's workers run (from the round loop's standby
call, 2 s after they started) and while it waits for a round (after :data:`WAIT_FIRST_S`, so that a
round that forms at once does not meet a preload). A watch ends when the situation changes.

A host with fewer usable cores than the node's workers + 2 cannot run their torch imports side by side
(with the agent's start-up and, on the leading node, the store host's): there the workers of a bare
server would share the cores for several imports each, and the first step would come later than if one
interpreter imported torch once and forked them all. So :func:`preload_first` decides whether the server
imports torch (not DDP's extras: those wait for an idle core as above) as it starts, before etcd and the
rendezvous, with the first round waiting for it (``ELASTICRUN_PRELOAD_FIRST`` forces either way).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Mapping, Optional, Tuple

from elasticrun.errors import ConfigError
from elasticrun.job.env import PRELOAD_FIRST

PROC_STAT = "/proc/stat"
SAMPLE_S = 0.5  # how long one idle sample lasts
IDLE_CORES = 1.0  # a core's worth of idle CPU over a sample: the preload takes nothing from the workers
LATEST_S = 10.0  # after this long watching, preload whatever the CPU does
WAIT_FIRST_S = 2.0  # waiting for a round: a round that forms this soon does not meet a preload

CpuTimes = Tuple[int, int]  # (idle jiffies, all jiffies) since boot


def parse_cpu_times(stat: str) -> Optional[CpuTimes]:
    """The host's (idle + iowait, total) jiffies from ``/proc/stat``'s ``cpu`` line; None if absent."""
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
            return values[3] + values[4], sum(values)
    return None


def idle_cores(before: CpuTimes, after: CpuTimes, cpus: int) -> float:
    """How many cores were idle on average between two samples (0 when no time passed)."""
    total = after[1] - before[1]
    if total <= 0:
        return 0.0
    return cpus * max(0, after[0] - before[0]) / total


def read_cpu_times(path: str = PROC_STAT) -> Optional[CpuTimes]:
    try:
        with open(path) as f:
            return parse_cpu_times(f.read())
    except OSError:
        return None  # not Linux: no sample, the deadline decides


def usable_cores() -> int:
    """The cores this process may run on (its affinity: taskset, a cpuset), else the host's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def preload_first(nproc: int, environ: Mapping[str, str], cores: Optional[int] = None) -> bool:
    """Whether the fork server imports torch before the first round's ``nproc`` workers: as
    ``ELASTICRUN_PRELOAD_FIRST`` says (``1``/``0``), else when ``cores`` (default: :func:`usable_cores`)
    are fewer than ``nproc + 2``. ConfigError (one line) for another value."""
    value = environ.get(PRELOAD_FIRST, "").strip().lower()
    if value in ("1", "0"):
        return value == "1"
    if value not in ("", "auto"):
        raise ConfigError(f"{PRELOAD_FIRST}={environ[PRELOAD_FIRST]!r}: use 1, 0 or auto")
    return (usable_cores() if cores is None else cores) < nproc + 2


def due(idle: float, watched_s: float, latest_s: float) -> bool:
    """Whether to preload now: a core was idle, or the watch has lasted ``latest_s``."""
    return idle >= IDLE_CORES or watched_s >= latest_s


class PreloadWatch:
    """One watch at a time; ``order`` (called under ``lock``, with the situation's ``still``) preloads."""

    def __init__(self, lock: threading.Lock, cpus: Optional[int] = None,
                 sample: Callable[[], Optional[CpuTimes]] = read_cpu_times) -> None:
        self._lock = lock  # held by the worker group while it starts workers: a preload never cuts in
        self._cpus = cpus or os.cpu_count() or 1
        self._sample = sample
        self._generation = 0
        self._watching = False

    def changed(self) -> None:
        """The situation changed (a round's workers started or stopped): any watch ends."""
        self._generation += 1
        self._watching = False

    def start(self, order: Callable[[], None], still: Callable[[], bool], first_s: float = 0.0,
              wanted: Callable[[], bool] = lambda: True) -> None:
        """Watch (unless a watch runs): after ``first_s``, ``order()`` once a core is idle, or at
        :data:`LATEST_S`, provided ``still()`` holds (it is checked again under the lock); while
        ``wanted()`` says there is nothing to preload yet, keep watching."""
        if self._watching:
            return
        self._watching = True
        args = (order, still, wanted, first_s, self._generation)
        threading.Thread(target=self._run, args=args, name="elasticrun-preload-watch", daemon=True).start()

    def _run(self, order: Callable[[], None], still: Callable[[], bool], wanted: Callable[[], bool],
             first_s: float, generation: int) -> None:
        began = time.monotonic()
        time.sleep(first_s)
        before = self._sample()
        while generation == self._generation:
            time.sleep(SAMPLE_S)
            if not wanted():  # nothing to preload yet (no worker imported DDP's modules): no sampling either
                before = None
                continue
            after = self._sample()
            idle = idle_cores(before, after, self._cpus) if before and after else 0.0
            before = after
            if due(idle, time.monotonic() - began, LATEST_S):
                with self._lock:
                    if generation == self._generation:
                        if still():
                            order()
                        self._watching = False
                return


__all__ = ["LATEST_S", "PreloadWatch", "WAIT_FIRST_S", "due", "idle_cores", "parse_cpu_times", "preload_first",
           "read_cpu_times", "usable_cores"]
