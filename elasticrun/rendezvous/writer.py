"""The rendezvous's writes to etcd: what the decisions of :mod:`~elasticrun.rendezvous.plan` and
:mod:`~elasticrun.rendezvous.roundend` decided, and what a node reports about its round.

A round and the job's end are written by compare-and-swap on the previous round's revision, so
that only one agent defines what follows a round; flags (``rounds/<n>/failed``, ``rounds/<n>/end``)
are first-wins.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Dict, List, Optional

from elasticrun.errors import StoreError
from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.plan import FormRound
from elasticrun.rendezvous.states import JobState
from elasticrun.store.client import EtcdStore

log = logging.getLogger(__name__)

EVENT_HISTORY = 50  # rounds whose rescale events and round keys are kept in etcd


class RoundWriter:
    """One agent's writes of the job's round records."""

    def __init__(self, store: EtcdStore, keys: JobKeys) -> None:
        self.store = store
        self.keys = keys

    def form(self, action: FormRound, prev_rev: int) -> bool:
        """Write round ``action.topology``, its event and (a restart) the restart history, while the
        round record is at ``prev_rev``; True when written (then older rounds are trimmed)."""
        topo = action.topology
        puts = [
            (self.keys.topology, json.dumps(topo.to_dict()), None),
            (self.keys.event(topo.round), json.dumps(action.event.to_dict()), None),
        ]
        if action.restarts is not None:
            puts.append((self.keys.restarts, json.dumps({"times": list(action.restarts)}), None))
        if not self.store.txn_put_many((self.keys.topology, prev_rev), puts):
            return False
        log.info("formed round %d: %s", topo.round, topo.node_ids)
        self.trim_history(topo.round)
        return True

    def end_job(self, state: JobState, reason: str, round_: int, topo_rev: int,
                exit_code: Optional[int] = None) -> bool:
        """Record the job's end while the round record is at ``topo_rev``; ``exit_code``: what every agent
        exits with (None: 0 or 1 by ``state``)."""
        record: Dict[str, Any] = {"state": state.value, "reason": reason, "round": round_, "time": time.time()}
        if exit_code is not None:
            record["exit_code"] = int(exit_code)
        return self.store.txn_put_many((self.keys.topology, topo_rev), [(self.keys.state, json.dumps(record), None)])

    def trim_history(self, newest: int) -> None:
        """Keep the newest EVENT_HISTORY rounds' events and round keys: everything older goes, in two
        range deletes after every round (nothing to delete costs etcd no write). A trim that failed or
        never ran (its agent died) is made up by the next one: the kept history has no gaps, and no
        old round stays behind."""
        first_kept = newest - EVENT_HISTORY + 1
        if first_kept <= 0:
            return
        try:
            self.store.delete_range(self.keys.events, self.keys.event(first_kept))
            self.store.delete_range(self.keys.rounds, self.keys.round(first_kept))
        except StoreError as err:  # the next round trims again
            log.warning("could not trim the job's round history: %s", err)

    def create_flag(self, key: str, record: Dict[str, Any], check: Callable[[Any], Any]) -> bool:
        """Create a first-wins flag (True when ours is written); a malformed one in its place, which every
        reader treats as absent, is replaced (compare-and-swap on its revision)."""
        value = json.dumps(record)
        if self.store.create(key, value):
            return True
        kv = self.store.get(key)
        if kv is not None and records.read(kv, check) is None:
            return self.store.cas(key, value, kv.mod_revision)
        return False

    def end_round(self, round_: int, reason: str, by: str, lost: Optional[str] = None) -> bool:
        """End round ``round_`` for everyone (``rounds/<n>/end``, first wins)."""
        record: Dict[str, Any] = {"reason": reason, "by": by}
        if lost is not None:
            record.update(lost=lost, time=time.time())
        return self.create_flag(self.keys.end(round_), record, records.end_flag)

    def joining(self, round_: int, newcomers: List[str]) -> None:
        """Tell every agent of round ``round_`` that newcomers will end it (``rounds/<n>/joining``)."""
        self.store.create(self.keys.joining(round_), json.dumps({"nodes": sorted(newcomers)}))

    def report_failure(self, round_: int, node_id: str, failures: List[Dict[str, Any]]) -> None:
        """Record our failed workers and flag the round failed (first flag wins)."""
        self.store.put_json(self.keys.failure(round_, node_id), failures)
        first = failures[0] if failures else {}
        flag = {"node": node_id, "rank": first.get("rank"), "time": time.time()}
        self.create_flag(self.keys.failed(round_), flag, records.failed_flag)

    def report_done(self, round_: int, node_id: str) -> None:
        """Our workers of round ``round_`` all exited 0."""
        self.store.put_json(self.keys.done(round_, node_id), {"time": time.time()})

    def mark_left(self, round_: int, node_id: str) -> None:
        """A graceful leave of round ``round_`` (before the lease is revoked): ``elasticrun status`` shows it Left."""
        self.store.put_json(self.keys.left(round_, node_id), {"time": time.time()})


__all__ = ["EVENT_HISTORY", "RoundWriter"]
