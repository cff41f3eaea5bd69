"""Requests to a running job (``elasticrun ckpt save``), and agreeing on them across ranks.

etcd contract (keys under ``/elasticrun/<job>/``)::

    control/checkpoint/<request_id>       = {"request_id": ..., "requested_at": ...}   written by the CLI
    control/checkpoint-done/<request_id>  = {"name": ..., "root": ..., "step": ...}     written by rank 0
                                          | {"error": "..."}

Rank 0 watches ``control/checkpoint/`` on a background thread with its own client. A
request without a ``checkpoint-done`` answer is pending; one left by an earlier round
(the job restarted before answering) is picked up again.

Only rank 0 hears about requests and only the worker that got SIGTERM knows it did, but
a checkpoint is a collective: every rank must decide the same thing at the same step.
:meth:`CheckpointRequests.poll` is that agreement: one tiny ``all_reduce(MAX)`` of
``[stop, pending requests, next interval]`` (plus, only when there are requests, a
broadcast of their ids). It costs about as much as one small collective (0.1-2 ms with
gloo on loopback, see docs/training.md), so by default (``every="auto"``) rank 0 picks
how many steps to wait before the next agreement so that one happens about every
``period`` seconds (0.2 s): negligible overhead, and a SIGTERM is acted on well within
the agent's grace period. ``every=k`` agrees every k steps instead.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from elasticrun.errors import ElasticrunError
from elasticrun.job.requests import ANSWER_TTL_S, answer_done, answer_error
from elasticrun.job.requests import parse_request as _parse_request
from elasticrun.train.abort import finish
from elasticrun.train.env import ElasticState
from elasticrun.train.etcdlink import EtcdLink

log = logging.getLogger(__name__)

# Relative to the job prefix (kept for importers); the keys come from elasticrun.job.keys.
REQUEST_DIR = "control/checkpoint/"
DONE_DIR = "control/checkpoint-done/"


@dataclass(frozen=True)
class StepDecision:
    """What every rank agreed on at a step boundary."""

    stop: bool = False
    request_ids: Tuple[str, ...] = ()
    checked: bool = False  # False on steps where no agreement ran

    @property
    def checkpoint(self) -> bool:
        """True when a checkpoint must be saved now (requested, or before stopping)."""
        return self.stop or bool(self.request_ids)


@dataclass
class _Inbox:
    pending: Dict[str, float] = field(default_factory=dict)  # request id -> requested_at
    in_flight: set = field(default_factory=set)  # handed to the loop, not answered yet
    answered: set = field(default_factory=set)
    outbox: List[Tuple[str, Dict[str, Any]]] = field(default_factory=list)


class CheckpointRequests:
    """Checkpoint requests + graceful stop, agreed by all ranks at step boundaries.

    Typical loop::

        requests = CheckpointRequests(ctx)
        for step in ...:
            train_step()
            decision = requests.poll(step, stop=ctx.should_stop)
            if decision.checkpoint or step % ckpt_every == 0:
                name = save(...)
                for rid in decision.request_ids:
                    requests.done(rid, name, root, step)
            if decision.stop:
                break
        requests.close()

    Without ``ELASTICRUN_RDZV_ENDPOINT`` there are never requests, but ``poll`` still
    agrees on ``stop``. ``done``/``fail`` are no-ops on ranks other than 0.
    """

    def __init__(
        self,
        state: Optional[ElasticState] = None,
        *,
        every: Union[int, str] = "auto",
        period: float = 0.2,
        max_every: int = 1000,
        endpoint: Optional[str] = None,
        job_id: Optional[str] = None,
        rank: Optional[int] = None,
        device: Optional[torch.device] = None,
        group: Optional[Any] = None,
        resync_interval: float = 30.0,
    ) -> None:
        if every != "auto" and (not isinstance(every, int) or every < 1):
            raise ValueError(f"every must be an int >= 1 or 'auto', got {every!r}")
        if state is not None and hasattr(state, "state"):  # an ElasticContext
            if group is None and getattr(state, "cpu_group", None) is not None:
                group = state.cpu_group  # agree over gloo on CPU: no GPU sync in the step
            elif group is None:
                device = device or state.device
            state = state.state
        state = state or ElasticState.from_env()
        self.every = every
        self.period = period
        self.max_every = max_every
        self._next_check = 0  # auto: the step of the next agreement (the same on every rank)
        self._last_check: Optional[Tuple[int, float]] = None  # auto, rank 0: (step, time)
        self.rank = state.rank if rank is None else rank
        self.device = device or torch.device("cpu")
        self.group = group
        self.resync_interval = resync_interval
        self.link = EtcdLink(
            state.rdzv_endpoint if endpoint is None else endpoint,
            state.rdzv_id if job_id is None else job_id,
            "checkpoint requests",
        )
        self._inbox = _Inbox()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._resync = threading.Event()
        self.agreements = 0
        self.agreement_seconds = 0.0
        self._thread: Optional[threading.Thread] = None
        if self.rank == 0:
            self._watch()

    # -- the training loop's side -----------------------------------------------------

    def regroup(self, group: Optional[Any] = None, rank: Optional[int] = None) -> None:
        """After an in-place re-form (:class:`~elasticrun.train.InPlace`): agree over ``group`` (the
        new round's; None: the default group) and at the next :meth:`poll` on every rank, so the
        survivors' agreement steps line up with a newcomer's (whose schedule starts afresh).
        ``rank``: this worker's rank in the new round; the one that becomes rank 0 (rank 0 left)
        starts watching for requests."""
        self.group = group
        self._next_check = 0
        self._last_check = None
        if rank is not None and rank != self.rank:
            self.rank = rank
            if rank == 0:
                self._watch()

    def _watch(self) -> None:
        """Rank 0: watch for requests on a background thread (once; not after :meth:`close`)."""
        if self._thread is None and self.link.enabled and not self._closed.is_set():
            self._resync.set()
            self._thread = threading.Thread(target=self._run, name="elasticrun-ckpt-requests", daemon=True)
            self._thread.start()


    def local_pending(self) -> List[str]:
        """Request ids rank 0 has seen and not yet handed to the loop (no collective)."""
        with self._lock:
            return sorted(self._inbox.pending, key=self._inbox.pending.__getitem__)

    def poll(self, step: int, stop: bool = False) -> StepDecision:
        """Collective (every rank must call it at the same steps): agree on ``stop`` and on the
        pending request ids. ``step`` must be the same on every rank. Runs only on agreement
        steps (``step % every == 0``, or as agreed in auto mode); otherwise returns at once
        with ``checked=False`` and nothing in it."""
        if not self._due(step):
            return StepDecision(stop=False, checked=False)
        ids = self.local_pending() if self.rank == 0 else []
        t0 = time.perf_counter()
        interval = self._choose_interval(step, t0) if self.every == "auto" and self.rank == 0 else 0
        if _distributed(self.group):
            flags = torch.tensor([1 if stop else 0, len(ids), interval], dtype=torch.int64, device=self.device)
            if self.device.type == "cpu":  # gloo: given up if a broken round's cut left it waiting
                finish(dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group, async_op=True), self.group)
            else:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            agreed_stop, count, interval = bool(flags[0].item()), int(flags[1].item()), int(flags[2].item())
            if count:
                box: List[Any] = [ids]
                dist.broadcast_object_list(box, src=_global_src(self.group), group=self.group,
                                           device=self.device if self.device.type != "cpu" else None)
                ids = list(box[0])
        else:
            agreed_stop = stop
        self.agreements += 1
        self.agreement_seconds += time.perf_counter() - t0
        if self.every == "auto":
            self._next_check = step + max(1, interval)
        if ids:
            with self._lock:
                for rid in ids:
                    self._inbox.pending.pop(rid, None)
                    self._inbox.in_flight.add(rid)
        return StepDecision(stop=agreed_stop, request_ids=tuple(ids), checked=True)

    def _due(self, step: int) -> bool:
        if self.every == "auto":
            return step >= self._next_check
        return step % int(self.every) == 0

    def _choose_interval(self, step: int, now: float) -> int:
        """Rank 0 (auto mode): agree again after about ``period`` seconds of steps."""
        last, self._last_check = self._last_check, (step, now)
        if last is None or step <= last[0]:
            return 1
        step_time = (now - last[1]) / (step - last[0])
        if step_time <= 0:
            return self.max_every
        return max(1, min(self.max_every, int(self.period / step_time)))

    def pending(self, step: int) -> List[str]:
        """``poll(step).request_ids`` (collective; use :meth:`poll` to also agree on stopping)."""
        return list(self.poll(step).request_ids)

    def done(self, request_id: str, name: str, root: str, step: int) -> None:
        """Answer a request with the checkpoint that satisfied it (rank 0; others: no-op)."""
        self._answer(request_id, answer_done(name, root, step))

    def fail(self, request_id: str, error: str) -> None:
        """Answer a request with an error (rank 0; others: no-op)."""
        self._answer(request_id, answer_error(error))

    def close(self, timeout: float = 3.0) -> None:
        """Send the answers still queued (waiting at most ``timeout`` s) and stop the watcher."""
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.link.close()

    def __enter__(self) -> CheckpointRequests:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def mean_agreement_ms(self) -> float:
        return 1000.0 * self.agreement_seconds / self.agreements if self.agreements else 0.0

    # -- rank 0's background thread ---------------------------------------------------

    def _answer(self, request_id: str, value: Dict[str, Any]) -> None:
        if self.rank != 0:
            return
        with self._lock:
            self._inbox.in_flight.discard(request_id)
            self._inbox.pending.pop(request_id, None)
            self._inbox.answered.add(request_id)
            if self.link.enabled:
                self._inbox.outbox.append((request_id, value))
        self._wake.set()

    def _offer(self, request_id: str, requested_at: float) -> None:
        with self._lock:
            box = self._inbox
            if request_id in box.answered or request_id in box.in_flight:
                return
            box.pending.setdefault(request_id, requested_at)

    def _withdraw(self, request_id: str) -> None:
        with self._lock:
            self._inbox.pending.pop(request_id, None)

    def _run(self) -> None:
        cancel = None
        backoff = 0.5
        last_sync = 0.0
        while True:
            closing = self._closed.is_set()
            if not closing and (self._resync.is_set() or time.monotonic() - last_sync > self.resync_interval):
                if cancel is not None:
                    cancel()
                    cancel = None
                cancel = self._sync_and_watch()
                if cancel is None:
                    self._wake.wait(backoff)
                    self._wake.clear()
                    backoff = min(backoff * 2, 5.0)
                    continue
                backoff, last_sync = 0.5, time.monotonic()
            self._flush()
            if closing:
                break
            self._wake.wait(1.0)
            self._wake.clear()
        if cancel is not None:
            cancel()

    def _sync_and_watch(self) -> Any:
        store = self.link.store()
        if store is None:
            return None
        try:
            self._resync.clear()
            reqs, rev = store.get_prefix(self.link.keys.checkpoint_requests)
            done, _ = store.get_prefix(self.link.keys.checkpoint_answers)
            answered = {kv.key.rsplit("/", 1)[-1] for kv in done}
            with self._lock:
                self._inbox.answered |= answered
            for kv in reqs:
                rid, at = _parse_request(kv.key, kv.value)
                if rid in answered:
                    store.delete(kv.key)  # answered before (its asker died): a leftover, not a request
                elif rid:
                    self._offer(rid, at)
            return store.watch_prefix(
                self.link.keys.checkpoint_requests, self._on_events, self._on_watch_error, start_revision=rev + 1
            )
        except ElasticrunError as err:
            self._resync.set()
            self.link.failed(err)
            return None

    def _on_events(self, events: List[Any]) -> None:
        for ev in events:
            if ev.deleted:
                self._withdraw(ev.key.rsplit("/", 1)[-1])
                continue
            rid, at = _parse_request(ev.key, ev.value)
            if rid:
                log.info("elasticrun: checkpoint request %s received", rid)
                self._offer(rid, at)

    def _on_watch_error(self, err: BaseException) -> None:
        if not self._closed.is_set():
            log.debug("checkpoint-request watch ended (%s); re-watching", err)
            self._resync.set()
            self._wake.set()

    def _flush(self) -> None:
        with self._lock:
            todo = list(self._inbox.outbox)
        if not todo:
            return
        store = self.link.store()
        if store is None:
            return
        for rid, value in todo:
            try:
                # On a lease: an answer nobody reads (its asker died) expires. The answered request
                # goes at once (the asker deletes both too): etcd keeps no checkpoint traffic.
                lease = store.grant_lease(ANSWER_TTL_S)
                store.put_json(self.link.keys.checkpoint_answer(rid), value, lease=lease)
                store.delete(self.link.keys.checkpoint_request(rid))
            except ElasticrunError as err:
                self.link.failed(err)
                return
            with self._lock:
                self._inbox.outbox.remove((rid, value))


def _distributed(group: Optional[Any]) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _global_src(group: Optional[Any]) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


__all__ = ["CheckpointRequests", "DONE_DIR", "REQUEST_DIR", "StepDecision"]
