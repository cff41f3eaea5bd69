"""What a ``rendezvous_agents.py`` shard counts: its agents' etcd requests, watch events, loop turns and
record parses, and how their keep-alives fare (the counters and maxima of a phase's answer).

:class:`Counts` wraps the shard's stores (``instrument``) and patches the protocol's view and loop
(``count_protocol``) so that the real code runs unchanged and is counted; with ``--clients agent``
it also routes the leases of the process's agents through one keep-alive thread
(``one_keepalive_thread``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

from rendezvous_keeper import Keeper  # noqa: E402 - a sibling file of this script

COUNTERS = ("watch_events", "loop_turns", "etcd_requests", "keepalives", "keepalives_failed", "node_parses",
            "topology_parses", "cas_won", "cas_lost", "rejoins", "etcd_retries")
# Keep-alives: the longest batch (sent -> every answer), the longest a lease waited between two.
# ka_age_max_s: the longest a lease went unconfirmed (from its grant or last confirmed keep-alive to
# the next answer); at the TTL an agent counts its lease as lost.
MAXIMA = ("ka_batch_max_s", "ka_gap_max_s", "ka_age_max_s")


class Counts:
    """The counters of one shard process, reset by each phase's answer (:meth:`take`)."""

    def __init__(self, keeper: Optional[Keeper]) -> None:
        self.keeper = keeper
        self.lock = threading.Lock()
        self.top_lock = threading.Lock()
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.maxima = dict.fromkeys(MAXIMA, 0.0)
        self.ka_last: Dict[int, float] = {}  # lease id -> when its last keep-alive was sent
        self.ka_confirmed: Dict[int, float] = {}  # lease id -> when it was granted or last confirmed (sent)
        self.ka_errors: List[str] = []  # keep-alive batches that failed (first ones), shown with a failed phase
        self.count_protocol()

    def take(self) -> Tuple[Dict[str, int], Dict[str, float], List[str]]:
        """The counters, maxima and first keep-alive errors since the last take; they start again from zero."""
        with self.lock:
            counts, self.counts = self.counts, dict.fromkeys(COUNTERS, 0)
            maxima, self.maxima = self.maxima, dict.fromkeys(MAXIMA, 0.0)
            ka_errors, self.ka_errors = self.ka_errors[:3], []
        return counts, maxima, ka_errors

    def bump(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``."""
        # No lock: one dict item += int is not interrupted by another thread (the GIL switches at calls
        # and jumps), and a lock taken by every agent's every request queued the threads of a process.
        self.counts[name] += n

    def count_protocol(self) -> None:
        """Count the views' watch events and record parses and the protocol's loop turns (patches the
        classes and parse functions of this process)."""
        from elasticrun.rendezvous import protocol

        view_mod = sys.modules[protocol.JobView.__module__]
        real_events = protocol.JobView._on_events

        def on_events(view: Any, events: Any, *args: Any) -> None:
            self.bump("watch_events", len(events))
            real_events(view, events, *args)

        protocol.JobView._on_events = on_events  # type: ignore[method-assign]
        for name, counter in (("parse_node", "node_parses"), ("parse_topology", "topology_parses")):
            real = getattr(view_mod, name)

            def counted(value: Any, *args: Any, _real: Any = real, _counter: str = counter) -> Any:
                self.bump(_counter)
                return _real(value, *args)

            setattr(view_mod, name, counted)
        real_beat = protocol.Rendezvous.beat

        def beat(rdzv: Any, busy_for: float = 0.0) -> None:
            self.bump("loop_turns")
            real_beat(rdzv, busy_for)

        protocol.Rendezvous.beat = beat  # type: ignore[method-assign]

    def one_keepalive_thread(self) -> None:
        """``--clients agent``: every agent's keep-alives go to etcd through this process's keeper; its
        agents' leases share one keep-alive thread and batch (as the leases of a shared client do), at
        normal priority, not a thread per agent's client at ``SCHED_IDLE``: 32 such threads of a process
        queued for the CPU and its interpreter lock past the heartbeat, and the lost leases cascaded into
        rejoins. Each agent keeps its own lease logic, gRPC channel, view and watch."""
        from elasticrun.store import lease as lease_mod

        assert self.keeper is not None, "the agents' keep-alives go through the keeper"
        route = SimpleNamespace(refresh_leases=self.counted_refresh(self.keeper.refresh))
        real = lease_mod.refresher_for

        def refresher_for(_store: Any, lease: Any) -> Any:
            ref = real(route, lease)
            # Started by an agent thread, the keep-alive thread is SCHED_IDLE as that thread; back to normal
            # (once per lease: the thread ends with its last lease, and a new one may reuse its id), so that
            # its turns come on time, as a real agent's do, while the agents here queue for the CPU.
            thread = ref._thread.native_id  # set once the thread started (0 would mean the caller)
            if thread is not None:
                try:
                    os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0))
                except (OSError, AttributeError):
                    pass
            return ref

        lease_mod.refresher_for = refresher_for  # type: ignore[assignment]

    def top(self, name: str, value: float) -> None:
        """Keep the largest ``value`` seen for maximum ``name``."""
        with self.top_lock:
            self.maxima[name] = max(self.maxima[name], value)

    def counted_refresh(self, real_many: Any) -> Any:
        """``refresh_leases`` that counts how the keep-alives fare: a batch's time in gRPC and etcd, and per
        lease the time since its last one (the refresher thread's turns; the TTL / 3 interval when on time)."""

        def refresh_many(ids: Any, timeout: Any = None) -> Any:
            t0 = time.monotonic()
            with self.lock:
                gaps = [t0 - self.ka_last[i] for i in ids if i in self.ka_last]
                self.ka_last.update(dict.fromkeys(ids, t0))
            self.top("ka_gap_max_s", max(gaps, default=0.0))
            self.bump("keepalives", len(ids))
            answers: Dict[int, int] = {}
            try:
                answers = real_many(ids, timeout)
                return answers
            except Exception as err:
                with self.lock:
                    if len(self.ka_errors) < 50:  # counted, not an agent's failure: its lease logic copes
                        self.ka_errors.append(f"keep-alive batch of {len(ids)} failed after "
                                           f"{time.monotonic() - t0:.2f} s: {err}")
                raise
            finally:
                now = time.monotonic()
                self.top("ka_batch_max_s", now - t0)
                with self.lock:
                    ages = [now - self.ka_confirmed.get(i, now) for i in ids]
                    self.ka_confirmed.update((i, t0) for i in ids if answers.get(i, 0) > 0)
                    self.counts["keepalives_failed"] += sum(1 for i in ids if i not in answers)
                self.top("ka_age_max_s", max(ages, default=0.0))

        return refresh_many

    def instrument(self, store: Any) -> Any:
        """``store`` with its requests, transactions, grants and keep-alives counted (grants and keep-alives
        through the keeper when there is one)."""
        real_call, real_txn = store._call, store.txn_put_many
        real_many = store.refresh_leases if self.keeper is None else self.keeper.refresh
        real_grant = store.grant_lease if self.keeper is None else self.keeper.grant

        def grant(ttl: int) -> int:
            t0 = time.monotonic()
            lease_id = real_grant(ttl)
            with self.lock:
                self.ka_confirmed[lease_id] = t0
            return int(lease_id)

        def call(what: str, fn: Any) -> Any:
            self.bump("etcd_requests")
            return real_call(what, fn)

        def txn(guard: Any, puts: Any) -> bool:
            ok = real_txn(guard, puts)
            self.bump("cas_won" if ok else "cas_lost")
            return ok

        store._call, store.txn_put_many, store.grant_lease = call, txn, grant
        store.refresh_leases = self.counted_refresh(real_many)
        return store
