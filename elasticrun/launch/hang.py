"""Hang detection (``--hang-timeout S``): a round whose training stopped advancing is restarted.

What counts as progress: the step that this node's local rank 0 reports with
:class:`elasticrun.train.ProgressReporter` (or :func:`elasticrun.train.heartbeat`), read from
``progress/<node-id>`` in etcd. Each agent watches its own node's key: once a report of the
current round was seen, a step that has not changed for S seconds means the node's workers
are stuck (a deadlock, a stuck collective, a device that stopped answering) — in a collective
every node stalls, so every agent notices. A script that never reports is never judged hung,
nor one whose reporter was closed (its last report says ``"closed": true``: training is over).

The agent then has every local worker write its Python stacks (all threads) to its stderr —
the worker bootstrap registers :mod:`faulthandler` for :data:`STACKS_SIGNAL` when hang
detection is on — so they reach the log with the worker's prefix, then reports the round
failed and stops it: the restart counts against ``--max-restarts`` like any worker failure.
Each worker's row says where its main thread stands: waiting in a ``torch.distributed``
collective (``waiting``) or anywhere else (``hung``); a rank that is not in a collective while
others wait in one is the one whose progress stopped first
(:func:`elasticrun.launch.failures.hang_verdict`, over every node's rows). The rows carry the
dumps without elasticrun's own frames.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from elasticrun.errors import ElasticrunError
from elasticrun.launch.failures import (
    TAIL_MAX,
    WAITING_IN,
    HangRole,
    WorkerFailure,
    clip_tail,
    hang_verdict,
    is_hang_row,
    stderr_tail,
)
from elasticrun.launch.stacks import THREAD_MARK, collective_waited_in, last_dump, user_view

STACKS_SIGNAL = signal.SIGUSR1  # what makes a worker dump its stacks (faulthandler, registered by warm.py)
STACKS_WAIT_S = 2.0  # how long the agent waits for the stacks to reach its log


class HangWatch:
    """Watch this node's progress key, one round at a time; :meth:`hung` once it stalled ``timeout`` s.

    A background thread (:meth:`start`) reads the key every ``min(1 s, timeout/4)``, so a slow or
    unreachable etcd never holds up the agent's loop; a stall is measured between reads that
    succeeded and starts over after a failed one, so an etcd outage is never taken for a hang.
    """

    def __init__(self, read: Callable[[], Any], timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read = read  # returns the progress report (a dict) or None; may raise ElasticrunError
        self.timeout = timeout
        self._clock = clock
        self.poll_every = min(1.0, timeout / 4)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.round = -1
        self.carried: Optional[int] = None  # the round our kept workers still train in (in-place re-form)
        self.step: Optional[int] = None  # the last step seen in this round
        self._advanced_at: Optional[float] = None  # when it last changed (None: not judging)
        self._seen_at = 0.0  # when the key was last read successfully
        self._gap = False  # a read failed since the last successful one

    def start_round(self, round_: int, carried: Optional[int] = None) -> None:
        """Judge reports of ``round_`` from now on (nothing until its first report). ``carried``: the
        round our workers still train in until they re-form in place into ``round_`` (their reports
        name it meanwhile, up to ``--inplace-ready-timeout`` while newcomers start). Once they start
        re-forming, the round loop starts ``round_`` again without it: the re-form's pause is no hang."""
        with self._lock:
            self.round, self.carried, self.step, self._advanced_at = round_, carried, None, None

    def start(self) -> HangWatch:
        """Poll in a daemon thread until :meth:`close`."""
        threading.Thread(target=self._run, name="elasticrun-hang-watch", daemon=True).start()
        return self

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(self.poll_every):
            self.poll()

    def poll(self) -> None:
        """Read the key once and note whether the step advanced."""
        try:
            value = self._read()
        except (ElasticrunError, ValueError):
            self._gap = True  # etcd trouble is the outage guard's business, not a hang
            return
        now = self._clock()
        with self._lock:
            self._seen_at = now
            if self._gap and self._advanced_at is not None:
                self._advanced_at = now  # the reporter could not write either: start over
            self._gap = False
            if not isinstance(value, dict) or value.get("round") not in (self.round, self.carried):
                return  # nothing yet, a previous round's report, or expired with a dead reporter
            step = value.get("step")
            if value.get("closed"):  # the reporter was closed: training is over, whatever comes next
                self.step, self._advanced_at = step, None
            elif step != self.step or self._advanced_at is None:
                self.step, self._advanced_at = step, now

    def stalled_for(self) -> float:
        """Seconds the step stood still, as of the last successful read (0 when not judging)."""
        with self._lock:
            return 0.0 if self._advanced_at is None else max(0.0, self._seen_at - self._advanced_at)

    def hung(self) -> bool:
        """True once the step has not advanced for ``timeout`` seconds."""
        return self.stalled_for() >= self.timeout


def hang_message(timeout: float) -> str:
    """The start of every hang row's message."""
    return f"no progress for {timeout:g} s"


def _dumps(worker: Any) -> int:
    return worker.err_pump.tail().count(THREAD_MARK) if worker.err_pump is not None else 0


def dump_stacks(workers: Sequence[Any], wait: float = STACKS_WAIT_S) -> None:
    """Have each running worker (``WorkerGroup.running``) write every thread's stack to its stderr,
    and wait (at most ``wait`` s) until each dump has come through its output pump to the log."""
    before = [_dumps(w) for w in workers]
    for w in workers:
        w.proc.send_signal(STACKS_SIGNAL)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and any(_dumps(w) <= n for w, n in zip(workers, before)):
        time.sleep(0.05)


def hang_row(node_id: str, host: str, rank: int, local_rank: int, tail: bytes, timeout: float,
             now: float) -> Dict[str, Any]:
    """One worker's failure row of a hang, from its stderr tail (which ends with its stack dump):
    ``signal`` is :attr:`HangRole.WAITING` when its main thread waits in a collective, else
    :attr:`HangRole.STOPPED`; the tail shown is the dump without elasticrun's and runpy's frames."""
    threads = last_dump(tail)
    waited = collective_waited_in(threads)
    if waited is not None:
        role, where = HangRole.WAITING, WAITING_IN + waited
    else:
        role, where = HangRole.STOPPED, "not in a collective" if threads else "no stack came"
    shown = clip_tail(user_view(threads), TAIL_MAX) if threads else (stderr_tail(tail) if tail else "")
    return WorkerFailure(node_id, host, rank, local_rank, 0, role.value, f"{hang_message(timeout)}: {where}", "",
                         now, shown).to_dict()


def hang_line(rows: List[Dict[str, Any]], timeout: float) -> str:
    """The agent's log line when it stops a round for a hang: who stopped first, as far as this
    node's rows tell."""
    verdict = hang_verdict(rows)
    note = f"; {verdict.note}" if verdict is not None else ""
    return f"{hang_message(timeout)}{note}; stacks above"


def skip_grace(stalled_for: float, timeout: float, rows: List[Dict[str, Any]]) -> bool:
    """Whether a round that ended while our workers' step stood still for ``stalled_for`` s ended for a
    detected hang (``rows``: the round's failure rows, every node's) in which they are stuck too: then
    they are stopped without the shutdown grace. Any other end (a scale-up, a leave, a crash) while
    the step stands still — a long save, an evaluation — gives them the grace."""
    return stalled_for >= timeout / 2 and any(is_hang_row(r) for r in rows)


def hang_failures(workers: Sequence[Any], timeout: float) -> List[Dict[str, Any]]:
    """The failure rows of a hang, one per running worker (``WorkerGroup.running``), after their stacks
    were dumped (:func:`dump_stacks`)."""
    now = time.time()
    return [hang_row(w.spec.member.node_id, w.spec.member.host, w.spec.rank, w.spec.local_rank,
                     w.err_pump.tail() if w.err_pump is not None else b"", timeout, now) for w in workers]


__all__ = ["STACKS_SIGNAL", "STACKS_WAIT_S", "HangWatch", "dump_stacks", "hang_failures", "hang_line", "hang_message",
           "hang_row", "skip_grace"]
