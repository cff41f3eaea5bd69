"""Child of a ``rendezvous_agents.py`` shard: grants the shard's leases and keeps them alive from a process of its own.

On a real cluster each agent's keep-alive thread shares its machine with one agent. Here hundreds of
simulated agents share a process and 2 cores at the lowest priority: the agents' own keep-alive
thread (``store/refresher.py``) can be starved for longer than a heartbeat, and etcd then expires
leases of agents that a real cluster would have kept (4,096 agents: a thousand leases lost in round
0). So this process, above the agents' priority (nice -5 where allowed, else 0):

- grants the shard's leases (a grant's answer that waits seconds for the agents' GIL no longer lets
  the lease expire before the agent's first keep-alive);
- sends the keep-alives the agents' refreshers hand it (one line in, one line out per batch; the
  requests that arrive while a batch is out go together in the next), and
- keeps every lease it granted alive on its own: a lease that nobody refreshed for half its TTL is
  refreshed here, until the agent drops it (a killed agent: ``drop``) or etcd says it is gone
  (revoked, or expired).

The agents' side still runs the real lease logic (its refresher, its local expiry); a simulated
agent's stalled loop (``stall_after``) does not stop these keep-alives, and the bench does not
measure the stall gate.

``Keeper`` is the shard's side (it starts this file as a process); ``main`` is the process.
Protocol, one JSON line each way, tagged with ``n``: ``{"n": 1, "grant": ttl}`` -> ``{"n": 1, "id": lease}``;
``{"n": 2, "ids": [...], "timeout": T}`` -> ``{"n": 2, "answers": {id: ttl}}``; ``{"drop": [...]}`` (no
answer); any request may be answered ``{"n": k, "error": "..."}``.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Tuple

WORKERS = 8  # grants the keeper process sends at once (agents that start together)
# A lease nobody refreshed for this fraction of its TTL is refreshed here. Later than the agents' own
# keep-alives (every third of the TTL): while their refresher runs on time, this sends nothing more.
BACKSTOP = 0.5
KEEPER_NICE = -5  # below etcd's priority, above the agents'


class Keeper:
    """The shard's keep-alive process (``rendezvous_keeper.py``)."""

    def __init__(self, endpoint: str) -> None:
        self.lock = threading.Lock()
        self.pending: Dict[int, Future] = {}
        self.number = 0
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), endpoint], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            raise RuntimeError("the keep-alive process failed to start")
        threading.Thread(target=self._read, name="keeper-replies", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            reply = json.loads(line)
            with self.lock:
                future = self.pending.pop(reply.pop("n"), None)
            if future is not None:
                future.set_result(reply)
        with self.lock:  # the process is gone: nobody answers the rest
            pending, self.pending = self.pending, {}
        for future in pending.values():
            future.set_result({"error": "the bench's keep-alive process died"})

    def _ask(self, request: Dict[str, Any], wait: bool = True) -> Dict[str, Any]:
        from elasticrun.errors import StoreError

        future: Future = Future()
        with self.lock:
            self.number += 1
            if wait:
                request["n"] = self.number
                self.pending[self.number] = future
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
            except (OSError, ValueError):  # closed at the end of the bench
                self.pending.pop(self.number, None)
                raise StoreError("the bench's keep-alive process is gone") from None
        if not wait:
            return {}
        reply = future.result()
        if "error" in reply:
            raise StoreError(reply["error"])
        return reply

    def grant(self, ttl: int) -> int:
        """``grant_lease`` there; the lease is then kept alive there until dropped or gone."""
        return int(self._ask({"grant": int(ttl)})["id"])

    def refresh(self, ids: Any, timeout: Any = None) -> Dict[int, int]:
        """``refresh_leases`` there."""
        answers = self._ask({"ids": [int(i) for i in ids], "timeout": timeout})["answers"]
        return {int(k): int(v) for k, v in answers.items()}

    def drop(self, ids: List[int]) -> None:
        """Stop keeping these leases alive (a killed agent: etcd expires them after the TTL)."""
        self._ask({"drop": [int(i) for i in ids]}, wait=False)

    def close(self) -> None:
        try:
            with self.lock:
                self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


class Leases:
    """The keeper process's leases: id -> (TTL, when its last keep-alive or grant was sent)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.lock = threading.Lock()
        self.held: Dict[int, Tuple[int, float]] = {}
        self.wake = threading.Event()

    def grant(self, ttl: int) -> int:
        sent = time.monotonic()
        lease_id = int(self.store.grant_lease(ttl))
        with self.lock:
            self.held[lease_id] = (ttl, sent)
        self.wake.set()
        return lease_id

    def refresh(self, ids: List[int], timeout: Any) -> Dict[int, int]:
        sent = time.monotonic()
        answers = self.store.refresh_leases(ids, timeout)
        with self.lock:
            for i, ttl in answers.items():
                if ttl <= 0:
                    self.held.pop(i, None)  # revoked or expired: etcd never renews it
                elif i in self.held:
                    self.held[i] = (self.held[i][0], max(sent, self.held[i][1]))
        return answers

    def drop(self, ids: List[int]) -> None:
        with self.lock:
            for i in ids:
                self.held.pop(i, None)

    def keep_alive(self) -> None:
        """Refresh every held lease that nobody refreshed for BACKSTOP of its TTL (runs for good)."""
        from elasticrun.errors import StoreError

        while True:
            now = time.monotonic()
            with self.lock:
                due = [i for i, (ttl, sent) in self.held.items() if now - sent >= ttl * BACKSTOP]
                nxt = min((sent + ttl * BACKSTOP for ttl, sent in self.held.values()), default=now + 1.0)
            if due:
                try:
                    answered = self.refresh(due, None)
                except StoreError:
                    answered = {}
                if len(answered) < len(due):
                    time.sleep(0.1)  # etcd did not answer them all: try again soon
                continue
            self.wake.wait(max(0.05, nxt - now))
            self.wake.clear()


def main(endpoint: str) -> None:
    from elasticrun.errors import StoreError
    from elasticrun.store.client import connect

    try:  # above the agents' threads too (see bench_rendezvous.raise_priority); threads made later inherit it
        os.setpriority(os.PRIO_PROCESS, 0, KEEPER_NICE)
    except OSError:
        pass  # not root: nice 0, still above the agents' SCHED_IDLE
    store = connect(endpoint, retry_timeout=60)
    leases = Leases(store)
    threading.Thread(target=leases.keep_alive, name="keep-alive", daemon=True).start()
    out_lock = threading.Lock()
    refreshes: queue.Queue[Dict[str, Any]] = queue.Queue()

    def answer(out: Dict[str, Any]) -> None:
        with out_lock:
            print(json.dumps(out), flush=True)

    def grant(req: Dict[str, Any]) -> None:
        try:
            answer({"n": req["n"], "id": leases.grant(int(req["grant"]))})
        except StoreError as err:
            answer({"n": req["n"], "error": str(err)})

    def refresh_batches() -> None:
        # Every refresh request that arrived while the last batch was out goes in the next one: with
        # --clients agent each agent's refresher sends its own lease, a thousand requests per interval.
        while True:
            reqs = [refreshes.get()]
            while not refreshes.empty():
                reqs.append(refreshes.get_nowait())
            ids = sorted({int(i) for r in reqs for i in r["ids"]})
            timeouts = [float(r["timeout"]) for r in reqs if r.get("timeout") is not None]
            try:
                answers = leases.refresh(ids, min(timeouts) if timeouts else None)
            except StoreError as err:
                for r in reqs:
                    answer({"n": r["n"], "error": str(err)})
                continue
            for r in reqs:
                answer({"n": r["n"], "answers": {str(i): answers[int(i)] for i in r["ids"] if int(i) in answers}})

    threading.Thread(target=refresh_batches, name="refresh-batches", daemon=True).start()
    print("ready", flush=True)
    with ThreadPoolExecutor(WORKERS) as pool:
        for line in sys.stdin:
            req = json.loads(line)
            if "drop" in req:
                leases.drop([int(i) for i in req["drop"]])
            elif "grant" in req:
                pool.submit(grant, req)
            else:
                refreshes.put(req)


if __name__ == "__main__":
    main(sys.argv[1])
