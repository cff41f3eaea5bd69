"""Per-step compute time of this rank: the time it spends outside collectives.

In synchronous training every rank's wall time per step is the same (all wait for the slowest in the
gradient all-reduce), so a slow rank cannot be told from its step time. What differs is the part of a
step before the rank enters the collective: :class:`StepTimer` measures it and the node's progress
report carries it to the leader, which scores every rank against the job's median
(:mod:`elasticrun.health.straggler`, ``--straggler-threshold``)::

    timer = et.step_timer(ddp)          # DDP: compute ends when the last gradient bucket is handed to NCCL/gloo
    for batch in data:
        with timer.step():
            loss = ddp(batch).sum(); loss.backward(); opt.step()

Without DDP, mark the end of the compute yourself (``timer.computed()`` before your all-reduce), or
time the compute parts (``with timer.compute(): ...``). The figure reported is the mean over the
steps of the last :data:`WINDOW_S` seconds (a mean, not a median: a rank stalled one step in ten
costs the job one step in ten). A script that never times its steps is never judged.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from typing import Any, Deque, Dict, Iterator, Optional, Tuple

from elasticrun.job import env as env_names

WINDOW_S = 10.0  # the mean is over the steps that ended in the last WINDOW_S seconds
WRITE_EVERY_S = 1.0  # a rank's figure is written to its node-local file at most this often
MAX_STEPS = 100_000  # at most this many steps in the window (memory bound at any step rate)


class StepTimer:
    """Times this rank's steps; :meth:`mean` is the recent mean compute seconds per step."""

    def __init__(self, clock: Any = time.monotonic, rank: Optional[int] = None) -> None:
        self._clock = clock
        self._rank = rank  # None: RANK from the environment, read at each write (an in-place re-form changes it)
        self._lock = threading.Lock()
        self._steps: Deque[Tuple[float, float]] = collections.deque(maxlen=MAX_STEPS)  # (ended at, compute s)
        self._start: Optional[float] = None
        self._mark: Optional[float] = None
        self._explicit = 0.0  # summed compute() blocks of the current step
        self._explicit_used = False
        self._folder = os.environ.get(env_names.STEP_TIMES_DIR, "").strip()
        self._file: Optional[_StepTimesFile] = None
        self._written = 0.0

    # -- marking a step ---------------------------------------------------------------------------

    def begin(self) -> None:
        """A step starts now."""
        self._start, self._mark, self._explicit, self._explicit_used = self._clock(), None, 0.0, False

    def computed(self) -> None:
        """This rank's compute of the step is done: from now on it waits in collectives (the last mark counts)."""
        self._mark = self._clock()

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Time a compute part of the step (the parts are summed; then marks are ignored)."""
        t0 = self._clock()
        try:
            yield
        finally:
            self._explicit += self._clock() - t0
            self._explicit_used = True

    def end(self) -> Optional[float]:
        """The step ended: its compute seconds (None when no step was begun)."""
        if self._start is None:
            return None
        now = self._clock()
        seconds = self._explicit if self._explicit_used else (self._mark or now) - self._start
        self._start = None
        with self._lock:
            self._steps.append((now, max(0.0, seconds)))
        if self._folder and now - self._written >= WRITE_EVERY_S:
            self._written = now
            mean = self.mean()
            if mean is not None:
                self._write(mean)
        return seconds

    @property
    def rank(self) -> int:
        return int(os.environ.get(env_names.RANK, "0") or 0) if self._rank is None else self._rank

    def _write(self, mean: float) -> None:
        rank = self.rank
        if self._file is None or self._file.rank != rank:
            self._file = _StepTimesFile(os.path.join(self._folder, str(rank)), rank)
        self._file.write(int(os.environ.get(env_names.ROUND, "0") or 0), mean)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """``begin()`` … ``end()`` around one training step."""
        self.begin()
        try:
            yield
        finally:
            self.end()

    # -- reading ------------------------------------------------------------------------------------

    def mean(self, window_s: float = WINDOW_S) -> Optional[float]:
        """Mean compute seconds per step over the steps that ended in the last ``window_s`` s (None: none)."""
        cutoff = self._clock() - window_s
        with self._lock:
            while self._steps and self._steps[0][0] < cutoff:
                self._steps.popleft()
            if not self._steps:
                return None
            return sum(s for _, s in self._steps) / len(self._steps)

    def watch(self, ddp: Any) -> StepTimer:
        """Mark compute done when ``ddp`` (a DistributedDataParallel model) hands each gradient bucket to its
        all-reduce (a comm hook; the all-reduce itself is DDP's default, averaged over the group). Call it
        again for a DDP model rebuilt after an in-place re-form."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses annotations other than its own
            self.computed()
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(ddp.process_group, hook)
        return self


class _StepTimesFile:
    """This rank's figure in the agent's node-local directory (``ELASTICRUN_STEP_TIMES_DIR/<rank>``),
    rewritten in place; the node's local rank 0 reads every rank's (:func:`node_step_times`)."""

    WIDTH = 64

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        self._fd: Optional[int] = None

    def write(self, round_: int, seconds: float) -> None:
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            line = f"{round_} {self.rank} {seconds:.9f}".ljust(self.WIDTH - 1)[: self.WIDTH - 1] + "\n"
            os.pwrite(self._fd, line.encode(), 0)
        except OSError:
            self._fd = None  # best effort: this rank is then not judged


def node_step_times(round_: int, folder: Optional[str] = None, max_age_s: float = 3 * WINDOW_S) -> Dict[int, float]:
    """Every local rank's figure of round ``round_`` written in the last ``max_age_s`` seconds."""
    folder = os.environ.get(env_names.STEP_TIMES_DIR, "").strip() if folder is None else folder
    found: Dict[int, float] = {}
    if not folder:
        return found
    try:
        names = os.listdir(folder)
    except OSError:
        return found
    now = time.time()
    for name in names:
        path = os.path.join(folder, name)
        try:
            if now - os.stat(path).st_mtime > max_age_s:
                continue
            with open(path, "rb") as f:
                fields = f.read(_StepTimesFile.WIDTH).split()
            if int(fields[0]) == round_:
                found[int(fields[1])] = float(fields[2])
        except (OSError, ValueError, IndexError):
            continue
    return found


_TIMER: Optional[StepTimer] = None


def step_timer(ddp: Any = None) -> StepTimer:
    """The process-wide :class:`StepTimer` (made on first use); ``ddp``: a DDP model to :meth:`~StepTimer.watch`.
    The node's :class:`~elasticrun.train.ProgressReporter` (and :func:`~elasticrun.train.heartbeat`) report it."""
    global _TIMER
    if _TIMER is None:
        _TIMER = StepTimer()
    if ddp is not None and hasattr(ddp, "register_comm_hook"):
        _TIMER.watch(ddp)
    return _TIMER


def current() -> Optional[StepTimer]:
    """The process-wide timer, if the script made one."""
    return _TIMER


__all__ = ["StepTimer", "current", "node_step_times", "step_timer"]
