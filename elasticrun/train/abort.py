"""Waking a worker whose collectives wait on a crashed peer, so that it can recover in place.

Over gloo a crashed peer's closed connection usually fails the survivors' collectives at once, but not
always: a survivor's collective was seen (the chaos soak, a killed node) to wait for the group's timeout,
on a live peer blocked in turn (the cut below wakes it) or, rarely, on a connection gloo itself had closed
without failing the collective (nothing outside gloo wakes that one). elasticrun's own step-boundary
agreements wait through :func:`finish`, which gives such a collective up :data:`ABANDON_S` after the cut.
Over NCCL it never does: a survivor's kernel waits
for the dead peer until torch's watchdog timeout (the group's ``timeout``), and its CPU thread waits with
it (``.item()``, a synchronize). The agent says when a
round's end broke its collectives (``<file>.recover`` with ``broken``: a crash or a lost node, never a
planned join or leave); :class:`BreakWatch` polls for that word on a daemon thread and then ends the
round's groups through its :class:`RoundAbort`: the gloo groups' connections are cut (blocked gloo
calls fail, :mod:`elasticrun.sockets`) and, over NCCL, every group's backend is aborted with torch's
``ProcessGroup.abort()`` (``ncclCommAbort``, whose kernels then end, so the blocked call returns).

The groups stay registered: ``dist.get_rank()`` and the like still answer, and a collective on an
aborted group fails. ``InPlace.recover`` destroys them afterwards, which flushes nothing and waits for
nothing after an abort (torch skips finalising an aborted communicator). An aborted NCCL all-reduce
leaves a partial result behind, and the device work queued after it runs once the kernel ends: the
optimizer step hook (:meth:`BreakWatch.gate`) keeps that result out of the parameters, by waiting for the
step's collectives before the update and refusing it when the round was aborted meanwhile.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional

log = logging.getLogger(__name__)

#: How often the watch looks for the agent's word (one ``open`` of a small file that is usually absent).
POLL_S = 0.05
#: After the round's groups were cut, how long a gloo collective may still wait before :func:`finish` gives
#: it up (a cut collective fails within milliseconds: one still waiting then never ends by itself).
ABANDON_S = 2.0
#: :func:`finish` waits in slices of this length, looking at the watch between them.
SLICE_S = 0.25


class RoundAbort:
    """Ends round ``round_``'s groups once, from whichever thread comes first: ``cut`` (the gloo groups'
    connections), then ``abort`` (every group's backend). :attr:`fired` is set before either runs, so a
    thread that a ``abort`` wakes sees it; :attr:`error` keeps what they raised (the round is over anyway);
    :attr:`cut_count` what ``cut`` returned (the connections it shut down, for the log)."""

    def __init__(self, round_: int, cut: Callable[[], object], abort: Callable[[], None]) -> None:
        self.round = round_
        self._cut = cut
        self._abort = abort
        self._lock = threading.Lock()
        self.fired = False
        self.fired_at = 0.0  # time.monotonic() when it fired
        self.error: Optional[BaseException] = None
        self.cut_count: object = None

    def fire(self) -> bool:
        """End the round's groups (blocks until done, also for a second caller); True for the call that did it."""
        with self._lock:
            if self.fired:
                return False
            self.fired, self.fired_at = True, time.monotonic()
            self.cut_count = self._attempt(self._cut)
            self._attempt(self._abort)
            return True

    def _attempt(self, step: Callable[[], object]) -> object:
        try:
            return step()
        except Exception as err:  # a group already half gone: what is left fails on use
            self.error = self.error or err
            log.warning("elasticrun: ending round %d's groups: %s", self.round, err)
            return None


class BreakWatch:
    """The current round's :class:`RoundAbort` and the daemon thread that fires it on the agent's word.

    ``round_now``: the round the worker runs in (it changes at a re-form); ``broken(r)``: whether the
    agent said round ``r``'s collectives broke. :meth:`arm` gives each round its own abort once its
    groups exist, so a word about an older round never ends a newer round's groups.
    """

    def __init__(self, round_now: Callable[[], int], broken: Callable[[int], bool], interval: float = POLL_S) -> None:
        self.round_now = round_now
        self.broken = broken
        self.interval = interval
        self.current: Optional[RoundAbort] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def arm(self, round_: int, cut: Callable[[], object], abort: Callable[[], None]) -> None:
        """Round ``round_``'s groups are formed: a broken round from now on ends these."""
        self.current = RoundAbort(round_, cut, abort)

    @property
    def fired(self) -> bool:
        """The current round's groups were aborted (or are being aborted)."""
        current = self.current
        return current is not None and current.fired

    def fired_ago(self) -> Optional[float]:
        """Seconds since the current round's groups were ended; None while they were not."""
        current = self.current
        return time.monotonic() - current.fired_at if current is not None and current.fired else None

    def poll(self) -> bool:
        """One look (the thread's loop body): fire the armed round's abort when the agent says the round the
        worker runs in broke and that is the armed round. True when this call fired it."""
        current, round_ = self.current, self.round_now()
        if current is None or current.round != round_ or current.fired:
            return False
        if not (self.broken(round_) and current.fire()):
            return False
        log.warning("elasticrun: the agent says round %d broke (a crash or a lost node): its groups were ended "
                    "(%s connection(s) cut)", round_, current.cut_count)
        return True

    def abort_now(self) -> None:
        """The worker's own thread saw its collective fail: end the round's groups now (once)."""
        if self.current is not None:
            self.current.fire()

    def gate(self, wait_device: Callable[[], None], fail: Callable[[str], BaseException]) -> None:
        """Before an optimizer step: wait for the step's collectives (``wait_device``: they ended, or an abort
        ended them), then raise ``fail(why)`` when the round was aborted (their results are partial)."""
        if not self.fired:
            wait_device()
        current = self.current
        if current is not None and current.fired:
            raise fail(f"round {current.round}'s collectives were aborted (a peer crashed or its node was lost): "
                       "the step is not applied; hand the error to InPlace.recover")

    def start(self) -> None:
        """Poll every :attr:`interval` seconds on a daemon thread until :meth:`stop`; :func:`finish` asks
        this watch meanwhile (one watch per process: the last started)."""
        global _ACTIVE
        _ACTIVE = self
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elasticrun-break-watch", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception as err:  # keep watching: one failed look must not leave the worker unwakeable
                log.warning("elasticrun: watching for a broken round: %s", err)


_ACTIVE: Optional[BreakWatch] = None  # the process's started watch, for finish()
_ABANDONED: List[Any] = []  # groups of given-up collectives, never freed (see finish)


def finish(work: Any, group: Any = None, abandon_s: float = ABANDON_S) -> None:
    """Wait for the gloo collective ``work`` (``async_op=True``) on ``group`` (None: the default group),
    raising what it raised; or raise ``torch.distributed.DistBackendError`` once this process's
    :class:`BreakWatch` ended the round's groups ``abandon_s`` ago and it still waits (its connection was
    closed by gloo without failing it: only the group's timeout would end it).

    A given-up collective keeps one of gloo's threads waiting, and the group's destructor would join that
    thread: the group is kept alive to the process's end, never freed (not even at interpreter exit).
    Not for NCCL: a timed wait there aborts the communicator on timeout; its groups are aborted instead.
    """
    while True:
        try:
            work.wait(timedelta(seconds=SLICE_S))
            return
        except RuntimeError:
            if work.is_completed():  # it failed (the cut, a peer gone), or it ended just after the slice timed out
                work.wait()  # returns at once, or raises its own failure: the caller's recovery takes it
                return
        watch = _ACTIVE
        ago = watch.fired_ago() if watch is not None else None
        if ago is not None and ago >= abandon_s:
            break
    import torch.distributed as dist

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    _ABANDONED.append(pg)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))  # interpreter exit must not free it either
    log.warning("elasticrun: a collective still waited %.1f s after its round's groups were cut: given up "
                "(its connection is gone; gloo would hold it until the group's timeout)", ago)
    raise dist.DistBackendError(f"a collective did not end {abandon_s:g} s after its round's groups were "
                                "cut: given up")


def abort_all_groups() -> None:
    """torch's abort of every process group of this process, the groups left registered (see the module
    docstring). NCCL communicators are aborted inside one NCCL group call, as
    ``torch.distributed.distributed_c10d._abort_process_group`` does, so that their aborts cannot
    wait on each other."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = c10d._world
    groups = sorted(world.pg_names, key=lambda pg: world.pg_names[pg], reverse=True)
    nccl = None
    default = c10d.GroupMember.WORLD
    if default is not None and dist.is_nccl_available():
        try:
            backend = default._get_backend(torch.device("cuda"))
        except RuntimeError:
            backend = None
        if isinstance(backend, dist.ProcessGroupNCCL):
            nccl = backend
    if nccl is not None:
        nccl._group_start()
    try:
        for pg in groups:
            pg.abort()
    finally:
        if nccl is not None:
            nccl._group_end()


__all__ = ["ABANDON_S", "POLL_S", "BreakWatch", "RoundAbort", "abort_all_groups", "finish"]
