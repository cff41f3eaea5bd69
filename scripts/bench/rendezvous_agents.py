"""Child process of ``bench_rendezvous.py``: a shard of simulated agents, driven over stdin.

Each simulated agent is a thread running the agent's own loop (:meth:`elasticrun.launch.agent.Agent._loop`, with
the agent's rendezvous settings) over a worker group that always runs (:class:`NoWorkers`); the agents of a
process share one etcd client and one job view (:class:`AgentView`). Commands, one a line, each answered with one
JSON line: ``go``, ``wait R T`` (up to T s until every live agent holds round R or later),
``kill I`` (agent I's lease is no longer refreshed, as for a SIGKILLed node), ``join I``, ``leave``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Set

from elasticrun.job.keys import JobKeys
from elasticrun.launch.agent import Agent
from elasticrun.launch.config import LaunchConfig, LogsConfig, RendezvousConfig, WorkersConfig
from elasticrun.launch.inplace import InPlaceRounds
from elasticrun.launch.workers import GroupState
from elasticrun.rendezvous.protocol import Rendezvous
from elasticrun.rendezvous.records import NodeInfo, Topology
from elasticrun.rendezvous.view import JobView
from elasticrun.store.client import connect

COUNTS = ("loop_turns", "rejoins", "etcd_waits")


class Killed(Exception):
    """Raised in a simulated agent's loop once the bench killed it (or made every agent leave)."""


class NoWorkers:
    """What the agent's loop sees of a node without workers: they run until stopped, and stop at once."""

    inplace = False
    running: List[Any] = []
    pids: List[int] = []
    extra_env: Dict[str, str] = {}
    started_how = "no workers (simulated agent)"

    def poll(self) -> GroupState:
        return GroupState.RUNNING

    def prewarm(self, deep: bool = False, preload: bool = True) -> None:
        pass

    def start(self, *_args: Any) -> None:
        pass

    def stop(self, grace: float, sig: int = signal.SIGTERM) -> None:
        pass

    def inplace_file(self, local_rank: int) -> str:
        return os.path.join(tempfile.gettempdir(), f"bench-rendezvous-no-worker-{os.getpid()}-{local_rank}")


class Say:
    """A simulated agent's progress lines, not printed: those about etcd (the outage guard's) are counted."""

    def __init__(self, count: Callable[[], None]) -> None:
        self.count = count

    def __call__(self, message: str) -> None:
        if "etcd" in message:
            self.count()

    def table(self, _table: Any) -> None:
        pass


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
        self.store = connect(endpoint, retry_timeout=60)
        self.view = JobView(self.store, JobKeys(job), nodes=False)  # the view the agents share
        self.leaders: Set[AgentView] = set()
        # min = N - 1: a round re-forms without a lost node; max = N: round 0 forms once all wait.
        self.rendezvous = dict(rdzv_endpoint=endpoint, rdzv_id=job, nnodes_min=max(1, nodes - 1), nnodes_max=nodes,
                               heartbeat_timeout=heartbeat, stability_window=0.5, rescale_timeout=120,
                               join_timeout=120, inplace=False)
        self.lock = threading.Lock()
        self.agents: Dict[int, Agent] = {}
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
        """Agent ``i`` and its rendezvous (its view read and watched), as the agent makes them."""
        cfg = LaunchConfig(rendezvous=RendezvousConfig(node_id=f"sim{i:05d}", **self.rendezvous),
                           workers=WorkersConfig(entrypoint="bench_rendezvous"), logs=LogsConfig(quiet=True))
        agent = Agent(cfg)
        agent.say = Say(lambda: self.bump("etcd_waits"))  # type: ignore[assignment]
        agent.inplace = InPlaceRounds(cfg, NoWorkers(), agent.say)  # type: ignore[arg-type]
        info = NodeInfo(node_id=cfg.rendezvous.node_id, host="sim", addr="127.0.0.1", nproc=1, pid=os.getpid())
        rdzv = Rendezvous(self.store, agent._settings(), info, host_store=lambda: 20000 + i % 40000,
                          on_progress=lambda _m: None, view=AgentView(self.view, self.leaders))
        rdzv.on_beat = lambda: self._beat(i)
        rdzv.next_round = self._holding(i, rdzv.next_round)  # type: ignore[method-assign]
        with self.lock:
            self.agents[i], self.rdzv[i], self.held[i] = agent, rdzv, {}
        return rdzv

    def _beat(self, i: int) -> None:
        """Each beat of agent ``i``'s loop: counted; Killed once the agent is dead."""
        self.bump("loop_turns")
        if i in self.dead:
            raise Killed()

    def _holding(self, i: int, next_round: Callable[[], Topology]) -> Callable[[], Topology]:
        """``next_round`` of agent ``i``, noting when it got each round."""

        def wrapped() -> Topology:
            topo = next_round()
            with self.lock:
                self.held[i][topo.round] = time.time()
            return topo

        return wrapped

    def start(self, i: int) -> None:
        self.started.add(i)
        threading.Thread(target=self._agent, args=(i,), name=f"sim{i}", daemon=True).start()

    def _agent(self, i: int) -> None:
        self.go.wait()
        rdzv = self.rdzv.get(i) or self.prepare(i)  # a node joining the running job connects as it starts
        agent = self.agents[i]
        try:
            rdzv.ensure_config(agent.cfg.job_settings())  # what Agent.run does before its loop
            rdzv.register()
            agent._loop(rdzv, NoWorkers())  # type: ignore[arg-type]
        except Killed:
            pass
        except Exception as err:  # noqa: BLE001 - reported to the parent
            if i not in self.dead:
                with self.lock:
                    self.errors.append(f"agent {i}: {err!r}")

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
        reply: Dict[str, Any] = {}
        if cmd == "go":
            shard.cpu0 = time.process_time()
            shard.go.set()
        elif cmd == "wait":
            reply = shard.wait(int(args[0]), float(args[1]))
        elif cmd == "kill":
            reply = {"killed": shard.kill(int(args[0]))}
        elif cmd == "join":
            shard.start(int(args[0]))
        else:
            shard.leave()
        print(json.dumps(reply), flush=True)
        if cmd == "leave":
            return

if __name__ == "__main__":
    main(sys.argv[1:])
