"""Child process of ``bench_rendezvous.py``: a shard of simulated agents, driven over stdin.

Each simulated agent is a thread running the agent's own rendezvous code, without workers: the real
:class:`~elasticrun.rendezvous.protocol.Rendezvous` (``ensure_config``, ``register``, ``next_round``,
the round watch) with every etcd call made through the agent's
:class:`~elasticrun.launch.outage.OutageGuard` (its retries through an outage, its fencing and
rejoining when the lease is lost), and, while it holds a round, the rendezvous calls of the agent's
round loop. The agents share one etcd client and one job view (:class:`AgentView`).

Commands, one line each, answered with one JSON line (but ``go``): ``go`` (the agents start), ``wait R
T`` (up to T s until every live agent holds round R or later: when each got it, the CPU and counts
since the last ``wait``), ``kill I`` (agent I, if ours, dies like a SIGKILLed node: its lease is no
longer refreshed), ``join I`` (start agent I here), ``leave`` (every agent leaves; the process exits).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Dict, List, Set

from elasticrun.job.keys import JobKeys
from elasticrun.launch.config import LaunchConfig, WorkersConfig
from elasticrun.launch.outage import OutageGuard
from elasticrun.rendezvous.protocol import LeaseLost, Rendezvous, RendezvousSettings
from elasticrun.rendezvous.records import NodeInfo, WorkerStatus
from elasticrun.rendezvous.view import JobView
from elasticrun.store.client import connect

# Without workers to look at (every 0.5 s in the agent's round loop) an agent waits for the view this long.
IDLE_WAIT_S = 5.0
COUNTS = ("loop_turns", "rejoins", "etcd_waits")


class AgentView:
    """One agent's handle on the job view its process's agents share: the view mirrors the node records
    while one of them leads, and *for this agent* only while it leads (so the leader's process alone
    receives their watch events, as the leader's machine alone does)."""

    lock = threading.Lock()

    def __init__(self, view: JobView, leaders: Set[AgentView]) -> None:
        self._view, self._leaders, self.leads = view, leaders, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)

    @property
    def mirrors_nodes(self) -> bool:
        return self.leads and self._view.mirrors_nodes

    def mirror_nodes(self, on: bool) -> None:
        with self.lock:
            if on != self.leads:
                (self._leaders.add if on else self._leaders.discard)(self)
                self.leads = on
                self._view.mirror_nodes(bool(self._leaders))

    def close(self) -> None:  # an agent that leaves does not close the view of those that stay
        self.mirror_nodes(False)


class Shard:
    """The agents of one child process."""

    def __init__(self, endpoint: str, job: str, nodes: int, heartbeat: float) -> None:
        self.nodes = nodes
        self.store = connect(endpoint, retry_timeout=60)
        self.view = JobView(self.store, JobKeys(job), nodes=False)  # the view the agents share
        self.leaders: Set[AgentView] = set()
        # min = N - 1: a round re-forms without a lost node; max = N: round 0 forms once all wait.
        self.settings = RendezvousSettings(job_id=job, min_nodes=max(1, nodes - 1), max_nodes=nodes, max_restarts=0,
                                           heartbeat_timeout=heartbeat, stability_window=0.5, rescale_timeout=120,
                                           join_timeout=120)
        # the outage guard's settings: the defaults
        self.cfg = LaunchConfig(workers=WorkersConfig(entrypoint="bench_rendezvous"))
        self.lock = threading.Lock()
        self.rdzv: Dict[int, Rendezvous] = {}
        self.held: Dict[int, Dict[int, float]] = {}
        self.started: set = set()
        self.dead: set = set()
        self.errors: List[str] = []
        self.counts = dict.fromkeys(COUNTS, 0)
        self.go = threading.Event()
        self.cpu0 = time.process_time()

    def bump(self, name: str) -> None:
        self.counts[name] += 1  # one dict item += int: not interrupted by another thread

    def prepare(self, i: int) -> Rendezvous:
        """Agent ``i``'s rendezvous (its view read and watched)."""
        info = NodeInfo(node_id=f"sim{i:05d}", host="sim", addr="127.0.0.1", nproc=1, pid=os.getpid())
        rdzv = Rendezvous(self.store, self.settings, info, host_store=lambda: 20000 + i % 40000,
                          on_progress=lambda _m: None, view=AgentView(self.view, self.leaders))
        rdzv.on_beat = lambda: self.bump("loop_turns")
        with self.lock:
            self.rdzv[i], self.held[i] = rdzv, {}
        return rdzv

    def start(self, i: int) -> None:
        self.started.add(i)
        threading.Thread(target=self._agent, args=(i,), name=f"sim{i}", daemon=True).start()

    def _agent(self, i: int) -> None:
        self.go.wait()
        rdzv = self.rdzv.get(i) or self.prepare(i)  # a node joining the running job connects as it starts
        no_workers = SimpleNamespace(stop=lambda grace, sig=0: None)  # what the guard stops when it fences
        guard = OutageGuard(self.cfg, rdzv, no_workers, lambda _m: self.bump("etcd_waits"))
        try:
            guard.call(lambda: rdzv.ensure_config({"nnodes": f"{self.settings.min_nodes}:{self.nodes}"}), "joining")
            rdzv.register()
            while i not in self.dead:
                try:
                    topo = guard.call(rdzv.next_round, "forming a round")
                    with self.lock:
                        self.held[i][topo.round] = time.time()
                    self._run_round(i, rdzv, guard, topo)
                except LeaseLost:  # as the agent does: fence, and join again under a new lease
                    self.bump("rejoins")
                    guard.call(rdzv.reregister, "rejoining")
        except Exception as err:  # noqa: BLE001 - reported to the parent
            if i not in self.dead:
                with self.lock:
                    self.errors.append(f"agent {i}: {err!r}")

    def _run_round(self, i: int, rdzv: Rendezvous, guard: OutageGuard, topo: Any) -> None:
        """The rendezvous calls of the agent's round loop, until the round is over for agent ``i``."""
        guard.call(lambda: rdzv.publish(status=WorkerStatus.ACTIVE, waiting_for=-1), "starting a round")
        version = rdzv.view_version()
        while i not in self.dead:
            rdzv.beat()
            if guard.check(topo) is not None or rdzv.round_change(topo) is not None:
                return
            due = rdzv.maybe_scale_up(topo)
            version = rdzv.wait_view(version, IDLE_WAIT_S if due is None else min(IDLE_WAIT_S, max(0.01, due)))

    def kill(self, i: int) -> bool:
        with self.lock:
            rdzv = self.rdzv.get(i)
            if rdzv is None:
                return False
            self.dead.add(i)
        if rdzv.lease is not None:
            rdzv.lease.stop()  # no revoke: etcd expires the lease after the TTL, as for a SIGKILL
        return True

    def wait(self, target: int, timeout: float) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.errors:
            with self.lock:
                if all(max(self.held.get(i, {}), default=-1) >= target for i in self.started - self.dead):
                    break
            time.sleep(0.05)
        with self.lock:
            held = {i: min((t for r, t in h.items() if r >= target), default=None)
                    for i, h in self.held.items() if i in self.started and i not in self.dead}
            counts, self.counts = self.counts, dict.fromkeys(COUNTS, 0)
            errors = self.errors[:5]
        cpu = time.process_time()
        reply = {"held": held, "errors": errors, "cpu_s": cpu - self.cpu0, **counts}
        self.cpu0 = cpu
        return reply

    def leave(self) -> None:
        with self.lock:  # every loop stops first: agents that see the others leave must not re-form meanwhile
            alive = [r for i, r in self.rdzv.items() if i not in self.dead]
            self.dead.update(self.rdzv)
        for rdzv in alive:
            with contextlib.suppress(Exception):  # leaving at the end of the bench
                rdzv.leave()


def main(argv: List[str]) -> None:
    endpoint, job, nodes, first, count, heartbeat = argv[:6]
    shard = Shard(endpoint, job, int(nodes), float(heartbeat))
    for i in range(int(first), int(first) + int(count)):
        shard.prepare(i)
        shard.start(i)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "go":
            shard.cpu0 = time.process_time()
            shard.go.set()
        elif cmd == "wait":
            print(json.dumps(shard.wait(int(args[0]), float(args[1]))), flush=True)
        elif cmd == "kill":
            print(json.dumps({"killed": shard.kill(int(args[0]))}), flush=True)
        elif cmd == "join":
            shard.start(int(args[0]))
            print(json.dumps({"joined": True}), flush=True)
        else:
            shard.leave()
            print(json.dumps({"left": True}), flush=True)
            return

if __name__ == "__main__":
    main(sys.argv[1:])
