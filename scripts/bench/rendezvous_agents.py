"""The simulated agents of ``bench_rendezvous.py``: threads running the agent's own loop (``Agent._loop``) over a
group without workers, a :class:`Shard` of them per process, sharing one etcd client and one job view."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from types import SimpleNamespace
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


def no_workers() -> Any:
    """What the agent's loop sees of a node without workers: they run until stopped, and stop at once."""
    path = os.path.join(tempfile.gettempdir(), f"bench-rendezvous-no-worker-{os.getpid()}-")
    return SimpleNamespace(inplace=False, running=[], pids=[], extra_env={}, started_how="no workers (simulated agent)",
                           poll=lambda: GroupState.RUNNING, prewarm=lambda **_kw: None, start=lambda *_a: None,
                           stop=lambda *_a, **_kw: None, inplace_file=lambda local_rank: f"{path}{local_rank}")


class Say:
    """A simulated agent's progress lines, not printed: a lost lease's rejoin and the outage guard's waits on etcd
    are counted."""

    def __init__(self, bump: Callable[[str], None]) -> None:
        self.bump = bump

    def __call__(self, message: str) -> None:
        if "rejoining" in message or "etcd" in message:
            self.bump("rejoins" if "rejoining" in message else "etcd_waits")

    def table(self, _table: Any) -> None:
        pass


class AgentView:
    """One agent's handle on its process's shared job view: the view mirrors the node records while one of them
    leads, and for this agent only while it leads (as the leader's machine alone receives their watch events)."""

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
    """The agents ``ids`` of one process (a ``multiprocessing`` manager's, driven by ``bench_rendezvous.py``)."""

    def __init__(self, endpoint: str, job: str, nodes: int, heartbeat: float, ids: List[int]) -> None:
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
        self.held: Dict[int, Dict[int, float]] = {}  # agent -> round -> when it got it
        self.started: Set[int] = set()
        self.dead: Set[int] = set()
        self.errors: List[str] = []
        self.counts = dict.fromkeys(COUNTS, 0)
        self.going = threading.Event()
        self.cpu0 = time.process_time()
        for i in ids:
            self.prepare(i)
            self.start(i)

    def go(self) -> None:
        """Every agent registers and forms round 0."""
        self.cpu0 = time.process_time()
        self.going.set()

    def bump(self, name: str) -> None:
        self.counts[name] += 1  # one dict item += int: not interrupted by another thread

    def prepare(self, i: int) -> Rendezvous:
        """Agent ``i`` and its rendezvous (its view read and watched), as the agent makes them."""
        cfg = LaunchConfig(rendezvous=RendezvousConfig(node_id=f"sim{i:05d}", **self.rendezvous),
                           workers=WorkersConfig(entrypoint="bench_rendezvous"), logs=LogsConfig(quiet=True))
        agent = Agent(cfg)
        agent.say = Say(self.bump)  # type: ignore[assignment]
        agent.inplace = InPlaceRounds(cfg, no_workers(), agent.say)
        info = NodeInfo(node_id=cfg.rendezvous.node_id, host="sim", addr="127.0.0.1", nproc=1, pid=os.getpid())
        rdzv = Rendezvous(self.store, agent._settings(), info, host_store=lambda: 20000 + i % 40000,
                          on_progress=lambda _m: None, view=AgentView(self.view, self.leaders))
        rdzv.on_beat = lambda: self._beat(i)
        next_round = rdzv.next_round
        rdzv.next_round = lambda: self._held(i, next_round())  # type: ignore[method-assign]
        with self.lock:
            self.agents[i], self.rdzv[i], self.held[i] = agent, rdzv, {}
        return rdzv

    def _beat(self, i: int) -> None:
        """Each beat of agent ``i``'s loop: counted; Killed once the agent is dead."""
        self.bump("loop_turns")
        if i in self.dead:
            raise Killed()

    def _held(self, i: int, topo: Topology) -> Topology:
        with self.lock:
            self.held[i][topo.round] = time.time()
        return topo

    def start(self, i: int) -> None:
        """Agent ``i`` runs (once :meth:`go` was called); a new one joins the job."""
        self.started.add(i)
        threading.Thread(target=self._agent, args=(i,), name=f"sim{i}", daemon=True).start()

    def _agent(self, i: int) -> None:
        self.going.wait()
        rdzv = self.rdzv.get(i) or self.prepare(i)  # a node joining the running job connects as it starts
        agent = self.agents[i]
        try:
            rdzv.ensure_config(agent.cfg.job_settings())  # what Agent.run does before its loop
            rdzv.register()
            agent._loop(rdzv, no_workers())
        except Killed:
            pass
        except Exception as err:  # noqa: BLE001 - reported to the parent
            if i not in self.dead:
                with self.lock:
                    self.errors.append(f"agent {i}: {err!r}")

    def kill(self, i: int) -> bool:
        """Agent ``i``'s lease is no longer refreshed, as for a SIGKILLed node; False: not an agent of this shard."""
        rdzv = self.rdzv.get(i)
        self.dead.add(i)  # harmless for an agent of another shard
        if rdzv is not None and rdzv.lease is not None:
            rdzv.lease.stop()  # no revoke: etcd expires the lease after the TTL, as for a SIGKILL
        return rdzv is not None

    def wait(self, target: int, timeout: float) -> Dict[str, Any]:
        """Up to ``timeout`` s until every live agent holds round ``target`` or later; when each got it, the CPU
        and the counts since the last call, the first errors."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.errors:
            with self.lock:
                if all(max(self.held.get(i, {}), default=-1) >= target for i in self.started - self.dead):
                    break
            time.sleep(0.05)
        with self.lock:
            held = {i: min((t for r, t in self.held[i].items() if r >= target), default=None)
                    for i in self.started - self.dead if i in self.held}
            counts, self.counts = self.counts, dict.fromkeys(COUNTS, 0)
            errors = self.errors[:5]
        cpu, self.cpu0 = time.process_time() - self.cpu0, time.process_time()
        return {"held": held, "errors": errors, "cpu_s": cpu, **counts}

    def leave(self) -> None:
        """Every agent leaves the job."""
        with self.lock:  # every loop stops first: agents that see the others leave must not re-form meanwhile
            alive = [r for i, r in self.rdzv.items() if i not in self.dead]
            self.dead.update(self.rdzv)
        for rdzv in alive:
            with contextlib.suppress(Exception):  # leaving at the end of the bench
                rdzv.leave()
