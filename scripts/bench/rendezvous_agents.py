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
share one keep-alive thread, as the leases of one client do (see ``Shard._one_keepalive_thread``).

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
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

from rendezvous_keeper import Keeper  # noqa: E402 - sibling files of this script
from rendezvous_views import AgentView, Profiler, SharedView  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")

COUNTERS = ("watch_events", "loop_turns", "etcd_requests", "keepalives", "keepalives_failed", "node_parses",
            "topology_parses", "cas_won", "cas_lost", "rejoins", "etcd_retries")
# Keep-alives: the longest batch (sent -> every answer), the longest a lease waited between two.
# ka_age_max_s: the longest a lease went unconfirmed (from its grant or last confirmed keep-alive to
# the next answer); at the TTL an agent counts its lease as lost.
MAXIMA = ("ka_batch_max_s", "ka_gap_max_s", "ka_age_max_s")
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
        self.top_lock = threading.Lock()
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.maxima = dict.fromkeys(MAXIMA, 0.0)
        self.ka_last: Dict[int, float] = {}  # lease id -> when its last keep-alive was sent
        self.ka_confirmed: Dict[int, float] = {}  # lease id -> when it was granted or last confirmed (sent)
        self._count_parses()
        self.connect = connect
        self.shared = self._open_store() if clients in ("process", "shared") else None
        if clients == "agent" and keeper is not None:
            self._one_keepalive_thread(keeper)
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
        self.ka_errors: List[str] = []  # keep-alive batches that failed (first ones), shown with a failed phase
        self.go = threading.Event()
        self.cpu0 = time.process_time()

    # -- counting ---------------------------------------------------------------------------

    def _bump(self, name: str, n: int = 1) -> None:
        # No lock: one dict item += int is not interrupted by another thread (the GIL switches at calls
        # and jumps), and a lock taken by every agent's every request queued the threads of a process.
        self.counts[name] += n

    def _count_parses(self) -> None:
        from elasticrun.rendezvous import protocol

        view_mod = sys.modules[protocol.JobView.__module__]
        real_events = protocol.JobView._on_events

        def on_events(view: Any, events: Any, *args: Any) -> None:
            self._bump("watch_events", len(events))
            real_events(view, events, *args)

        protocol.JobView._on_events = on_events  # type: ignore[method-assign]
        for name, counter in (("parse_node", "node_parses"), ("parse_topology", "topology_parses")):
            real = getattr(view_mod, name)

            def counted(value: Any, _real: Any = real, _counter: str = counter) -> Any:
                self._bump(_counter)
                return _real(value)

            setattr(view_mod, name, counted)
        real_beat = protocol.Rendezvous.beat

        def beat(rdzv: Any, busy_for: float = 0.0) -> None:
            self._bump("loop_turns")
            real_beat(rdzv, busy_for)

        protocol.Rendezvous.beat = beat  # type: ignore[method-assign]

    def _one_keepalive_thread(self, keeper: Keeper) -> None:
        """``--clients agent``: every agent's keep-alives go to etcd through this process's keeper; its
        agents' leases share one keep-alive thread and batch (as the leases of a shared client do), at
        normal priority, not a thread per agent's client at ``SCHED_IDLE``: 32 such threads of a process
        queued for the CPU and its interpreter lock past the heartbeat, and the lost leases cascaded into
        rejoins. Each agent keeps its own lease logic, gRPC channel, view and watch."""
        from elasticrun.store import lease as lease_mod

        route = SimpleNamespace(refresh_leases=self._counted_refresh(keeper.refresh))
        real = lease_mod.refresher_for
        raised: set = set()

        def refresher_for(_store: Any, lease: Any) -> Any:
            ref = real(route, lease)
            thread = ref._thread.native_id  # started by an agent thread: SCHED_IDLE, as that thread
            if thread is not None and thread not in raised:  # back to normal: its turns come on time, as a
                raised.add(thread)  # real agent's do, while the agents here queue for the CPU
                try:
                    os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0))
                except (OSError, AttributeError):
                    pass
            return ref

        lease_mod.refresher_for = refresher_for  # type: ignore[assignment]

    def _top(self, name: str, value: float) -> None:
        with self.top_lock:
            self.maxima[name] = max(self.maxima[name], value)

    def _open_store(self) -> Any:
        store = self.connect(self.endpoint, retry_timeout=60)
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
            self._bump("etcd_requests")
            return real_call(what, fn)

        def txn(guard: Any, puts: Any) -> bool:
            ok = real_txn(guard, puts)
            self._bump("cas_won" if ok else "cas_lost")
            return ok

        store._call, store.txn_put_many, store.grant_lease = call, txn, grant
        store.refresh_leases = self._counted_refresh(real_many)
        return store

    def _counted_refresh(self, real_many: Any) -> Any:
        """``refresh_leases`` that counts how the keep-alives fare: a batch's time in gRPC and etcd, and per
        lease the time since its last one (the refresher thread's turns; the TTL / 3 interval when on time)."""

        def refresh_many(ids: Any, timeout: Any = None) -> Any:
            t0 = time.monotonic()
            with self.lock:
                gaps = [t0 - self.ka_last[i] for i in ids if i in self.ka_last]
                self.ka_last.update(dict.fromkeys(ids, t0))
            self._top("ka_gap_max_s", max(gaps, default=0.0))
            self._bump("keepalives", len(ids))
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
                self._top("ka_batch_max_s", now - t0)
                with self.lock:
                    ages = [now - self.ka_confirmed.get(i, now) for i in ids]
                    self.ka_confirmed.update((i, t0) for i in ids if answers.get(i, 0) > 0)
                    self.counts["keepalives_failed"] += sum(1 for i in ids if i not in answers)
                self._top("ka_age_max_s", max(ages, default=0.0))

        return refresh_many

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
                    self._bump("rejoins")
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
                self._bump("etcd_retries")
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
            counts, self.counts = self.counts, dict.fromkeys(COUNTERS, 0)
            maxima, self.maxima = self.maxima, dict.fromkeys(MAXIMA, 0.0)
            errors = list(self.errors[:5]) + ([f"... {len(self.errors)} errors in all"] if len(self.errors) > 5 else [])
            ka_errors, self.ka_errors = self.ka_errors[:3], []
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
            shard.counts = dict.fromkeys(COUNTERS, 0)  # round 0's, not the connecting's requests
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
