"""Child process of ``bench_rendezvous.py``: a shard of simulated agents, driven over stdin.

Each simulated agent is a thread that runs the real protocol
(:class:`elasticrun.rendezvous.protocol.Rendezvous`: view + watch, lease and keep-alive,
``ensure_config``, ``register``, ``next_round``) and, while it holds a round, the agent's round
loop without workers (publish Active, ``round_change``, ``maybe_scale_up``, wait for the view).

Before it prints ``ready``, every agent of the shard is connected, untimed: its etcd client (with
``--clients agent``: a gRPC channel per agent) and its view, whose read and watch are set up, in
batches of PREPARE_BATCH at a time — so the timed phases measure the protocol, not the harness
opening a thousand channels at once. An agent that joins later (``join``) connects when it starts,
as a real node does.

The agents run at ``SCHED_IDLE``; their leases are granted and kept alive by a helper process of
higher priority (``rendezvous_keeper.py``): on a real cluster neither etcd nor an agent's keep-alive
shares its CPU with a thousand other agents. With ``--clients agent`` the leases of a process's agents
share one keep-alive thread, as the leases of one client do (``rendezvous_counts.py``, which also
counts what the agents do).

Commands (one line each; every command but ``go`` answers one JSON line):

- ``go``: the agents start (``ensure_config``, ``register``, ``next_round``...);
- ``wait R T``: wait up to T s until every live agent here holds round R or later; answers the
  time each agent got it and the counters of the phase (CPU, watch events, loop turns, etcd
  requests, records parsed); the counters start again from zero;
- ``kill I``: agent I (if it is ours) dies like a SIGKILLed node: its thread stops and its
  lease is no longer refreshed (etcd expires it after the heartbeat timeout);
- ``join I``: start agent I here (a node joining the running job);
- ``leave``: every agent leaves (revokes its lease); the process exits.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from rendezvous_counts import Counts  # noqa: E402 - sibling files of this script
from rendezvous_keeper import Keeper  # noqa: E402
from rendezvous_views import AgentView, Profiler, SharedView  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")

PREPARE_BATCH = 16  # agents connected at once before ``ready``
# The agent's round loop looks at its workers every 0.5 s; a simulated agent has none, so it waits for
# the view to change (or this long): 4,096 agents waking twice a second cost this machine a core.
IDLE_WAIT_S = 5.0


class Shard:
    """The agents of one child process."""

    def __init__(self, endpoint: str, job: str, nodes: int, heartbeat: float, clients: str,
                 keeper: Optional[Keeper] = None, ramp: float = 0.0) -> None:
        from elasticrun.job.keys import JobKeys
        from elasticrun.rendezvous import protocol
        from elasticrun.rendezvous.protocol import RendezvousSettings
        from elasticrun.store.client import connect

        self.endpoint, self.job, self.nodes, self.clients = endpoint, job, nodes, clients
        self.keeper = keeper
        self.ramp = ramp  # --ramp of bench_rendezvous.py: round 0's agents start over this many seconds
        self.lock = threading.Lock()
        self.counts = Counts(keeper)  # what the phases report
        self.connect = connect
        self.shared = self._open_store() if clients in ("process", "shared") else None
        if clients == "agent" and keeper is not None:
            self.counts.one_keepalive_thread()
        if clients == "shared":  # one mirror of the job for all our agents, each with its own handle on it
            shared = SharedView(protocol.JobView(self.shared, JobKeys(job), nodes=False))
            protocol.JobView = lambda *_a, **_kw: AgentView(shared)  # type: ignore[assignment,misc]
        # min = N - 1: a round re-forms without a lost node; max = N: round 0 forms once all wait.
        self.settings = RendezvousSettings(
            job_id=job, min_nodes=max(1, nodes - 1), max_nodes=nodes, max_restarts=0, heartbeat_timeout=heartbeat,
            stability_window=0.5, rescale_timeout=120, join_timeout=120,
        )
        self.held: Dict[int, Dict[int, float]] = {}
        self.started: set = set()
        self.rdzv: Dict[int, Any] = {}
        self.dead: set = set()
        self.errors: List[str] = []  # agents that failed: the phase fails
        self.go = threading.Event()
        self.cpu0 = time.process_time()

    def _open_store(self) -> Any:
        return self.counts.instrument(self.connect(self.endpoint, retry_timeout=60))

    # -- agents -----------------------------------------------------------------------------

    def prepare(self, i: int) -> None:
        """Connect agent ``i``: its etcd client (``--clients agent``) and its view (read and watch)."""
        from elasticrun.rendezvous.protocol import Rendezvous
        from elasticrun.rendezvous.records import NodeInfo

        try:
            info = NodeInfo(node_id=f"sim{i:05d}", host="sim", addr="127.0.0.1", nproc=1, pid=os.getpid())
            store = self.shared or self._open_store()
            rdzv = Rendezvous(store, self.settings, info, host_store=lambda: 20000 + i % 40000,
                              on_progress=lambda _m: None)
        except Exception as err:  # noqa: BLE001 - reported to the parent
            with self.lock:
                self.errors.append(f"agent {i}: could not connect: {err!r}")
            return
        with self.lock:
            self.rdzv[i] = rdzv
            self.held[i] = {}

    def prepare_all(self, agents: List[int]) -> None:
        """Connect ``agents`` before the timed phases, PREPARE_BATCH at a time (see the module docstring)."""
        for at in range(0, len(agents), PREPARE_BATCH):
            threads = [threading.Thread(target=self.prepare, args=(i,)) for i in agents[at:at + PREPARE_BATCH]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    def start(self, i: int) -> None:
        self.started.add(i)
        threading.Thread(target=self._agent, args=(i,), name=f"sim{i}", daemon=True).start()

    def _agent(self, i: int) -> None:
        from elasticrun.rendezvous.protocol import LeaseLost

        self.go.wait()
        if self.ramp > 0 and i < self.nodes:  # round 0's agents start spread over the ramp, as nodes do
            time.sleep(self.ramp * i / self.nodes)
        if i not in self.rdzv:
            self.prepare(i)  # a node joining the running job connects as it starts
        rdzv = self.rdzv.get(i)
        if rdzv is None:
            return
        try:
            rdzv.ensure_config({"nnodes": f"{self.settings.min_nodes}:{self.nodes}", "bench": True})
            rdzv.register()
            while i not in self.dead:
                try:
                    self._one_round(i, rdzv)
                except LeaseLost:  # as the agent does: fence, and join again under a new lease
                    self.counts.bump("rejoins")
                    rdzv.reregister()
        except Exception as err:  # noqa: BLE001 - reported to the parent
            if i not in self.dead:
                lease = getattr(rdzv, "lease", None)
                more = "" if lease is None else (f" (lease {lease.health().value}, unconfirmed for "
                                                 f"{lease.unconfirmed_for():.1f} s)")
                with self.lock:
                    self.errors.append(f"agent {i}: {err!r}{more}")

    def _one_round(self, i: int, rdzv: Any) -> None:
        """Agent ``i`` joins the next round, holds it, and runs the agent's round loop (without workers)
        until the round is over; LeaseLost when its lease is gone."""
        from elasticrun.rendezvous.records import WorkerStatus

        topo = self._retrying(rdzv, rdzv.next_round)
        with self.lock:
            self.held[i][topo.round] = time.time()
        self._retrying(rdzv, rdzv.publish, status=WorkerStatus.ACTIVE, waiting_for=-1)
        version = view_version(rdzv)
        while i not in self.dead:
            rdzv.beat()
            if self._retrying(rdzv, rdzv.round_change, topo) is not None:
                return
            due = self._retrying(rdzv, rdzv.maybe_scale_up, topo)
            version = wait_view(rdzv, version, IDLE_WAIT_S if due is None else min(IDLE_WAIT_S, max(0.01, due)))

    def _retrying(self, rdzv: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, retried through etcd errors as the agent's outage guard retries them
        (``etcd_retries``); LeaseLost once etcd says our lease is gone."""
        from elasticrun.errors import StoreError
        from elasticrun.rendezvous.protocol import LeaseLost
        from elasticrun.store.lease import LeaseHealth

        while True:
            try:
                return fn(*args, **kwargs)
            except StoreError as err:
                lease = rdzv.lease
                if lease is None or lease.health() is LeaseHealth.LOST:
                    raise LeaseLost((lease.lost_reason if lease else None) or str(err)) from None
                self.counts.bump("etcd_retries")
                time.sleep(0.5)

    def kill(self, i: int) -> bool:
        with self.lock:
            rdzv = self.rdzv.get(i)
            if rdzv is None:
                return False
            self.dead.add(i)
        if rdzv.lease is not None:
            rdzv.lease.stop()  # no revoke: etcd expires the lease after the TTL, as for a SIGKILL
            if self.keeper is not None:
                self.keeper.drop([rdzv.lease.lease_id])
        return True

    def wait(self, target: int, timeout: float) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                live = self.started - self.dead
                if all(max(self.held.get(i, {}), default=-1) >= target for i in live):
                    break
                if self.errors:
                    break
            time.sleep(0.05)
        with self.lock:
            held = {i: min((t for r, t in h.items() if r >= target), default=None)
                    for i, h in self.held.items() if i not in self.dead}
            counts, maxima, ka_errors = self.counts.take()
            errors = list(self.errors[:5]) + ([f"... {len(self.errors)} errors in all"] if len(self.errors) > 5 else [])
        cpu = time.process_time()
        out = {"held": held, "errors": errors, "ka_errors": ka_errors, "cpu_s": cpu - self.cpu0, **counts, **maxima}
        self.cpu0 = cpu
        return out

    def leave(self) -> None:
        with self.lock:  # first every loop stops: agents that see the others leave must not re-form meanwhile
            alive = [(i, rdzv) for i, rdzv in self.rdzv.items() if i not in self.dead]
            self.dead.update(self.rdzv)
        for _i, rdzv in alive:
            try:
                rdzv.leave()
            except Exception:  # noqa: BLE001 - leaving at the end of the bench
                pass


def view_version(rdzv: Any) -> int:
    """``rdzv.view_version()``; the view's version on revisions before it (to bench them too)."""
    return rdzv.view_version() if hasattr(rdzv, "view_version") else rdzv.view.version


def wait_view(rdzv: Any, version: int, timeout: float) -> int:
    """``rdzv.wait_view()``, as the agent's round loop waits; the view's on older revisions."""
    if hasattr(rdzv, "wait_view"):
        return int(rdzv.wait_view(version, timeout))
    return int(rdzv.view.wait_change(version, timeout))


def quiet_grpc_waits() -> None:
    """gRPC's Python threads that wait for a streaming call's next message (each watch stream) wake every
    0.1 s so that a main thread can run its signal handlers (``grpc._common.MAXIMUM_WAIT_TIMEOUT``). A
    real agent has one such thread; hundreds of simulated agents in one process had thousands of
    wake-ups a second queue for the GIL, and the keep-alives waited behind them for seconds. No agent
    thread here is the main thread: they wait until they are notified (or 5 s)."""
    import grpc._common

    grpc._common.MAXIMUM_WAIT_TIMEOUT = 5.0


def main(argv: List[str]) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 <pid>: where every thread is
    endpoint, job, nodes, first, count, heartbeat, clients = argv[:7]
    keeper = None if os.environ.get("BENCH_RENDEZVOUS_KEEPER") == "0" else Keeper(endpoint)  # before SCHED_IDLE
    # The simulated agents yield the CPU to etcd and to the keep-alives: on a real cluster they run on
    # machines of their own, and etcd starved by its own clients' simulation turns its answers into the
    # bench's bottleneck. SCHED_IDLE: they run when nothing else wants the CPU; else nice 10.
    priority = os.environ.get("BENCH_RENDEZVOUS_PRIORITY", "idle")
    if priority == "idle" and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(10 if priority == "idle" else int(priority))
    quiet_grpc_waits()
    profile: Optional[Profiler] = Profiler(argv[7]) if argv[7] else None
    shard = Shard(endpoint, job, int(nodes), float(heartbeat), clients, keeper, float(argv[8]))
    mine = list(range(int(first), int(first) + int(count)))
    shard.prepare_all(mine)
    if profile is not None:  # the untimed connecting, apart: a phase's profile is this one's difference
        profile.dump(f"prepare-{first}")
    for i in mine:
        shard.start(i)
    print("ready", flush=True)
    phase = 0
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "go":
            shard.cpu0 = time.process_time()
            shard.counts.take()  # round 0's counts, not the connecting's requests
            shard.go.set()
            continue
        if cmd == "wait":
            reply: Dict[str, Any] = shard.wait(int(args[0]), float(args[1]))
            if profile is not None:
                profile.dump(f"phase{phase}-{first}")
            phase += 1
        elif cmd == "kill":
            reply = {"killed": shard.kill(int(args[0]))}
        elif cmd == "join":
            shard.start(int(args[0]))
            reply = {"joined": True}
        else:
            shard.leave()
            if keeper is not None:
                keeper.close()
            print(json.dumps({"left": True}), flush=True)
            return
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
