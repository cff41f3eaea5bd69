"""Waking a worker whose collectives wait on a crashed peer, so that it can recover in place.

Over gloo a crashed peer's closed connection usually fails the survivors' collectives at once, but not
always: a survivor's collective was seen (the chaos soak, a killed node) to wait for the group's timeout,
on a live peer blocked in turn (the cut below wakes it) or, rarely, on a connection gloo itself had closed
without failing the collective (nothing outside gloo wakes that one: docs/reliability.md). Over NCCL it
never does: a survivor's kernel waits
for the dead peer until torch's watchdog timeout (the group's ``timeout``), and its CPU thread waits with
it (``.item()``, a synchronize). The agent says when a
round's end broke its collectives (``<file>.recover`` with ``broken``: a crash or a lost node, never a
planned join or leave); :class:`BreakWatch` polls for that word on a daemon thread and then ends the
round's groups through its :class:`RoundAbort`: the gloo groups' connections are cut (blocked gloo
calls fail, :mod:`elasticrun.train.sockets`) and, over NCCL, every group's backend is aborted with torch's
``ProcessGroup.abort()`` (``ncclCommAbort``, whose kernels then end, so the blocked call returns).

The groups stay registered: ``dist.get_rank()`` and the like still answer, and a collective on an
aborted group fails. ``InPlace.recover`` destroys them afterwards, which flushes nothing and waits for
nothing after an abort (torch skips finalising an aborted communicator). An aborted NCCL all-reduce
leaves a partial result behind, and the device work queued after it runs once the kernel ends: the
optimizer step hook (:meth:`BreakWatch.gate`) keeps that result out of the parameters, by waiting for the
step's collectives before the update and refusing it when the round was aborted meanwhile.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

log = logging.getLogger(__name__)

#: How often the watch looks for the agent's word (one ``open`` of a small file that is usually absent).
POLL_S = 0.05


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
        self.error: Optional[BaseException] = None
        self.cut_count: object = None

    def fire(self) -> bool:
        """End the round's groups (blocks until done, also for a second caller); True for the call that did it."""
        with self._lock:
            if self.fired:
                return False
            self.fired = True
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
        """Poll every :attr:`interval` seconds on a daemon thread until :meth:`stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="elasticrun-break-watch", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
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


__all__ = ["POLL_S", "BreakWatch", "RoundAbort", "abort_all_groups"]
