"""The rendezvous's work per agent does not grow with the job: a quadratic regression fails.

16 and then 64 simulated agents (threads sharing one etcd client, each with its own view and
lease) form round 0 on a real etcd and run it (every agent publishes Active, as its workers
start); then one agent dies (its lease is revoked) and the others re-form round 1. Counted per
agent — counts, not times, so load cannot flake them: the watch events its view received, the
node records it parsed and looked at, and the requests, writes and watch events etcd served
(etcd's own counters). Each must stay within 2x from 16 to 64 agents: a cost quadratic in the
nodes is 4x per agent there.

The leader's looks at the nodes while a round forms are counted apart and not checked: they are
paced by time (a look per change, batched at most every 0.5 ms x nodes, and one every 0.25 s
without a change), so a job that takes longer to form sees more of them: 9-24 looks at 16 agents
and 39-82 at 64 over eight runs here, 1.3x-3.3x per agent (3.8x in one CI run), with the same
counts on the code before and after the record-boundary and reuse changes.
"""

from __future__ import annotations

import sys
import threading
import uuid
from pathlib import Path
from typing import Any, Dict, List

import pytest

from elasticrun.rendezvous import protocol
from elasticrun.rendezvous.protocol import Rendezvous, RendezvousSettings
from elasticrun.rendezvous.records import NodeInfo, WorkerStatus
from elasticrun.store.client import connect
from elasticrun.store.server import EtcdServer

from helpers.procs import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: scripts/
from scripts.bench.etcd_metrics import etcd_counters  # noqa: E402 - the bench's reading of etcd's counters

pytestmark = pytest.mark.integration  # starts etcd or processes

SMALL, LARGE = 16, 64
GROWTH = 2.0  # per-agent counts may grow this much from SMALL to LARGE agents (quadratic: LARGE / SMALL = 4)
UNCHECKED = {"forming_nodes_looked_at"}  # the leader's time-paced looks while a round forms (see above)


class Counts:
    """Per-process counters of the agents' work (wrapped around the view's methods)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Lock()
        self.c = {"events": 0, "node_parses": 0, "nodes_looked_at": 0, "forming_nodes_looked_at": 0}
        view_cls = protocol.JobView
        view_mod = sys.modules[view_cls.__module__]
        on_events, nodes, parse = view_cls._on_events, view_cls.nodes, view_mod.parse_node
        forming = Rendezvous._forming
        in_forming = threading.local()  # set while the leader gathers what plan_round decides on

        def counted_events(view: Any, events: Any, *args: Any) -> None:
            self.add("events", len(events))
            on_events(view, events, *args)

        def counted_nodes(view: Any) -> Any:
            got = nodes(view)
            self.add("forming_nodes_looked_at" if getattr(in_forming, "on", False) else "nodes_looked_at", len(got))
            return got

        def counted_forming(rdzv: Any, *args: Any) -> Any:
            in_forming.on = True
            try:
                return forming(rdzv, *args)
            finally:
                in_forming.on = False

        def counted_parse(value: Any, *args: Any) -> Any:
            self.add("node_parses", 1)
            return parse(value, *args)

        monkeypatch.setattr(view_cls, "_on_events", counted_events)
        monkeypatch.setattr(view_cls, "nodes", counted_nodes)
        monkeypatch.setattr(Rendezvous, "_forming", counted_forming)
        monkeypatch.setattr(view_mod, "parse_node", counted_parse)

    def add(self, name: str, n: int) -> None:
        with self.lock:
            self.c[name] += n


def run_job(endpoint: str, n: int, counts: Counts) -> Dict[str, float]:
    """N agents: round 0, run it, one dies, round 1. The work per agent."""
    job = f"scale-{n}-{uuid.uuid4().hex[:6]}"
    store = connect(endpoint)
    settings = RendezvousSettings(job_id=job, min_nodes=n - 1, max_nodes=n, max_restarts=0, heartbeat_timeout=5,
                                  stability_window=0.2, rescale_timeout=60, join_timeout=60)
    held: Dict[int, List[int]] = {i: [] for i in range(n)}
    dead: set = set()
    errors: List[BaseException] = []
    agents: Dict[int, Rendezvous] = {}

    def agent(i: int) -> None:
        try:
            info = NodeInfo(node_id=f"n{i:03d}", host="h", addr="127.0.0.1", nproc=1, pid=1)
            rdzv = agents[i] = Rendezvous(store, settings, info, lambda: 29500)
            rdzv.ensure_config({"nnodes": f"{n - 1}:{n}"})
            rdzv.register()
            while i not in dead:
                topo = rdzv.next_round()
                held[i].append(topo.round)
                rdzv.publish(status=WorkerStatus.ACTIVE, waiting_for=-1)
                version = rdzv.view_version()
                while i not in dead and rdzv.round_change(topo) is None:
                    rdzv.beat()
                    rdzv.maybe_scale_up(topo)
                    version = rdzv.wait_view(version, 0.5)
        except BaseException as err:  # noqa: BLE001 - reported below
            if i not in dead:
                errors.append(err)

    before = etcd_counters(endpoint)
    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: errors or all(0 in held[i] for i in range(n)), 60, f"{n} agents in round 0")
        assert not errors, errors
        victim = n // 2
        dead.add(victim)
        agents[victim].leave()  # its lease is revoked: its node record vanishes, as at a lease expiry
        wait_until(lambda: errors or all(1 in held[i] for i in range(n) if i != victim), 60, "round 1")
        assert not errors, errors
    finally:
        dead.update(range(n))
        for rdzv in agents.values():
            rdzv.leave()
        for t in threads:
            t.join(10)
        store.close()
    after = etcd_counters(endpoint)
    per_agent = {k: v / n for k, v in counts.c.items()}
    for k in counts.c:
        counts.c[k] = 0
    per_agent.update({
        "etcd_requests": (after["unary_requests"] - before["unary_requests"]) / n,
        "etcd_writes": (after["revision"] - before["revision"]) / n,
        "etcd_events_sent": (after["events_sent"] - before["events_sent"]) / n,
    })
    return per_agent


def test_work_per_agent_does_not_grow_with_the_nodes(monkeypatch: pytest.MonkeyPatch):
    server = EtcdServer().start()  # its own: its counters see only this test
    try:
        counts = Counts(monkeypatch)
        small = run_job(server.endpoint, SMALL, counts)
        large = run_job(server.endpoint, LARGE, counts)
    finally:
        server.stop()
    grew = {k: (small[k], large[k]) for k in small if k not in UNCHECKED and large[k] > GROWTH * small[k] + 1.0}
    assert not grew, (
        f"work per agent grows with the nodes ({SMALL} -> {LARGE} agents, per agent): {grew}; all: {small} -> {large}"
    )
    assert small["etcd_writes"] < 10 and small["etcd_requests"] < 40, small  # and stays small
