#!/usr/bin/env python
"""Rendezvous time against node count: N simulated agents, one real etcd, no workers.

Each simulated agent is a thread running the real protocol
(:class:`elasticrun.rendezvous.protocol.Rendezvous`: its own JobView watch, lease and
keep-alive, ``ensure_config`` + ``register`` + ``next_round``) with a fake store port.
Agents are sharded over a few child processes, each with its own ``EtcdStore`` (one gRPC
channel per process), like real nodes would have one each.

Measured from the moment every child is told "go" (all imports and connections done) to
the moment each agent holds round 0; the job is ``--nnodes N`` (min = max = N), so the
round forms as soon as all N agents wait. Also counted: topology compare-and-swaps that
lost (CAS contention) and won (must be 1), and the watch events the agents' views received
(per agent: about constant when only the leader watches the node records, ~2N when all do).

There is no alternative launcher to run at these sizes; the ``summary`` of ``--json`` compares
with the project's target instead: 5 s at 256 agents, scaled linearly below (N/256 x 5 s, at least 1 s).

    python scripts/bench/bench_rendezvous.py                       # 8 32 128 256 agents, 3 runs each
    python scripts/bench/bench_rendezvous.py --nodes 256 --procs 4 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")


# -- child: runs a shard of agents ------------------------------------------------------------


def child(endpoint: str, job: str, nodes: int, first: int, count: int, heartbeat: float, clients: str) -> None:
    """Run agents ``first .. first+count-1``; wait for 'go' on stdin; print one JSON result line.

    ``clients``: "agent" gives every simulated agent its own EtcdStore (its own gRPC channel,
    watch stream and watch thread, like a real node); "process" shares one EtcdStore per
    process (each agent still has its own JobView, i.e. its own watch); "shared" also shares
    one JobView (one watch stream, one mirror) among the agents of a process.
    """
    from elasticrun.job.keys import JobKeys
    from elasticrun.rendezvous import protocol
    from elasticrun.rendezvous.protocol import Rendezvous, RendezvousSettings
    from elasticrun.rendezvous.records import NodeInfo
    from elasticrun.rendezvous.view import JobView
    from elasticrun.store.client import EtcdStore, connect

    counts = {"cas_won": 0, "cas_lost": 0, "watch_events": 0}
    lock = threading.Lock()
    real_on_events = JobView._on_events

    def counting_on_events(self: Any, events: Any, *args: Any) -> None:
        with lock:
            counts["watch_events"] += len(events)
        real_on_events(self, events, *args)

    JobView._on_events = counting_on_events  # type: ignore[method-assign]

    def open_store() -> EtcdStore:
        store = connect(endpoint, retry_timeout=60)
        real_txn = store.txn_put_many

        def counting_txn(guard: Any, puts: Any) -> bool:
            ok = real_txn(guard, puts)
            with lock:
                counts["cas_won" if ok else "cas_lost"] += 1
            return ok

        store.txn_put_many = counting_txn  # type: ignore[method-assign]
        return store

    shared = open_store() if clients in ("process", "shared") else None
    stores = {i: shared or open_store() for i in range(first, first + count)}
    if clients == "shared":
        assert shared is not None
        view = JobView(shared, JobKeys(job))  # with the node records: whichever agent of ours leads uses them
        view.mirror_nodes = lambda _on: None  # type: ignore[method-assign]  # one mirror for leader and others
        protocol.JobView = lambda *_args, **_kw: view  # type: ignore[assignment,misc]
    settings = RendezvousSettings(
        job_id=job, min_nodes=nodes, max_nodes=nodes, max_restarts=0, heartbeat_timeout=heartbeat,
        stability_window=0.5, rescale_timeout=120, join_timeout=120,
    )
    results: Dict[int, Dict[str, float]] = {}
    errors: List[str] = []
    agents: List[Any] = []
    go = threading.Event()

    def agent(i: int) -> None:
        go.wait()
        t0 = time.time()
        try:
            info = NodeInfo(node_id=f"sim{i:04d}", host="sim", addr="127.0.0.1", nproc=1, pid=os.getpid())
            rdzv = Rendezvous(stores[i], settings, info, host_store=lambda: 20000 + i, on_progress=lambda _m: None)
            with lock:
                agents.append(rdzv)
            rdzv.ensure_config({"nnodes": f"{nodes}:{nodes}", "bench": True})
            rdzv.register()
            t_reg = time.time()
            topo = rdzv.next_round()
            t_round = time.time()
            assert topo.member(info.node_id) is not None and len(topo.members) == nodes
            results[i] = {"start": t0, "registered": t_reg, "round": t_round}
        except Exception as err:  # noqa: BLE001 - reported to the parent
            with lock:
                errors.append(f"agent {i}: {err!r}")

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(first, first + count)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    cpu0 = time.process_time()
    go.set()
    for t in threads:
        t.join(180)
    cpu = time.process_time() - cpu0
    print(json.dumps({"results": results, "errors": errors[:5], "cpu_s": cpu, **counts}), flush=True)
    sys.stdin.readline()  # leave only when told: a leaving agent would end the round for the others
    for rdzv in agents:
        rdzv.leave()
    for store in set(stores.values()):
        store.close()


# -- parent ---------------------------------------------------------------------------------


def _cpu(pid: Optional[int]) -> float:
    if pid is None:
        return 0.0
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def run_once(
    endpoint: str, nodes: int, procs: int, heartbeat: float, clients: str, etcd_pid: Optional[int] = None
) -> Dict[str, Any]:
    """One rendezvous of ``nodes`` agents over ``procs`` processes; the timings and CPU seconds used."""
    job = f"bench-{nodes}-{uuid.uuid4().hex[:6]}"
    procs = max(1, min(procs, nodes))
    shard = [nodes // procs + (1 if p < nodes % procs else 0) for p in range(procs)]
    children = []
    first = 0
    for count in shard:
        cmd = [sys.executable, __file__, "--child", endpoint, job, str(nodes), str(first), str(count), str(heartbeat),
               clients]
        children.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        first += count
    try:
        for c in children:
            line = c.stdout.readline()  # type: ignore[union-attr]
            if line.strip() != "ready":
                raise RuntimeError(f"child failed to start: {line!r}")
        etcd_cpu0 = _cpu(etcd_pid)
        t_go = time.time()
        for c in children:
            c.stdin.write("go\n")  # type: ignore[union-attr]
            c.stdin.flush()  # type: ignore[union-attr]
        merged: Dict[str, Any] = {"results": {}, "errors": [], "cas_won": 0, "cas_lost": 0, "cpu_s": 0.0,
                                  "watch_events": 0}
        for c in children:
            line = c.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError("a child died before reporting")
            part = json.loads(line)
            merged["results"].update(part["results"])
            merged["cas_won"] += part["cas_won"]
            merged["cas_lost"] += part["cas_lost"]
            merged["watch_events"] += part["watch_events"]
            merged["errors"] += part["errors"]
            merged["cpu_s"] += part["cpu_s"]
        etcd_cpu = _cpu(etcd_pid) - etcd_cpu0
        for c in children:
            c.stdin.write("leave\n")  # type: ignore[union-attr]
            c.stdin.flush()  # type: ignore[union-attr]
        for c in children:
            c.wait(60)
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
    rows = list(merged["results"].values())
    if len(rows) != nodes:
        raise RuntimeError(f"only {len(rows)} of {nodes} agents got the round: {merged['errors']}")
    return {
        "nodes": nodes,
        "procs": procs,
        "all_registered_s": max(r["registered"] for r in rows) - t_go,
        "first_round_s": min(r["round"] for r in rows) - t_go,
        "all_round_s": max(r["round"] for r in rows) - t_go,
        "cas_won": merged["cas_won"],
        "cas_lost": merged["cas_lost"],
        "agents_cpu_s": merged["cpu_s"],
        "watch_events": merged["watch_events"],
        "watch_events_per_agent": merged["watch_events"] / nodes,
        "etcd_cpu_s": etcd_cpu if etcd_pid else None,
    }


def summary_rows(rows: List[Dict[str, Any]], sizes: List[int], command: str) -> List[Dict[str, Any]]:
    """The preamble's ``summary``: median time to round 0 per size against the linear target."""
    out: List[Dict[str, Any]] = []
    for n in sizes:
        mine = [r["all_round_s"] for r in rows if r["nodes"] == n]
        if not mine:
            continue
        med = statistics.median(mine)
        target = max(1.0, 5.0 * n / 256)
        out.append({
            "metric": f"rendezvous of {n} agents (one etcd client each) -> all hold round 0", "elasticrun": med,
            "alternative": "target (5 s at 256 agents, linear)", "alt_value": target, "unit": "s",
            "better": "lower", "ratio": target / med if med > 0 else 0.0, "device": "cpu", "command": command,
        })
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        endpoint, job, nodes, first, count, heartbeat, clients = sys.argv[2:9]
        child(endpoint, job, int(nodes), int(first), int(count), float(heartbeat), clients)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 128, 256])
    ap.add_argument("--procs", type=int, default=4, help="child processes the agents are sharded over")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--clients", choices=["agent", "process", "shared"], default="agent",
        help="agent: an etcd client (gRPC channel + watch) per simulated agent, like real nodes; process: one "
        "client per process, a watch per agent; shared: one client and one watch+mirror (JobView) per process",
    )
    ap.add_argument("--heartbeat", type=float, default=10.0, help="lease TTL of the simulated agents")
    ap.add_argument("--endpoint", default="", help="use this etcd instead of starting one")
    ap.add_argument("--json", action="store_true", help="print the raw rows as JSON too")
    args = ap.parse_args()

    from elasticrun.store.server import EtcdServer

    server = None
    endpoint = args.endpoint
    etcd_pid = None
    if not endpoint:
        server = EtcdServer().start()
        endpoint = server.endpoint
        etcd_pid = server.proc.pid if server.proc is not None else None
    rows = []
    try:
        print(
            f"etcd {endpoint}; {os.cpu_count()} CPUs; agents sharded over up to {args.procs} processes; "
            f"--clients {args.clients}"
        )
        print(
            f"{'nodes':>6} {'run':>4} {'registered':>11} {'first has':>10} {'all have':>9} {'CAS lost':>9} "
            f"{'agents CPU':>11} {'etcd CPU':>9} {'events/agent':>13}"
        )
        for n in args.nodes:
            for run in range(args.runs):
                r = run_once(endpoint, n, args.procs, args.heartbeat, args.clients, etcd_pid)
                rows.append(r)
                print(
                    f"{n:>6} {run + 1:>4} {r['all_registered_s']:>10.3f}s {r['first_round_s']:>9.3f}s "
                    f"{r['all_round_s']:>8.3f}s {r['cas_lost']:>9} {r['agents_cpu_s']:>10.2f}s "
                    f"{(r['etcd_cpu_s'] or 0):>8.2f}s {r['watch_events_per_agent']:>13.1f}",
                    flush=True,
                )
        print("\nmedian over runs (seconds from 'go' to every agent holding round 0):")
        for n in args.nodes:
            mine = [r for r in rows if r["nodes"] == n]
            med = statistics.median(r["all_round_s"] for r in mine)
            lost = statistics.median(r["cas_lost"] for r in mine)
            print(f"  {n:>4} nodes: {med:.3f} s  ({med / n * 1000:.1f} ms/node), CAS lost (median) {lost:g}")
        if args.json:
            command = " ".join(["python", "scripts/bench/bench_rendezvous.py", *sys.argv[1:]])
            print(json.dumps({"rows": rows, "summary": summary_rows(rows, args.nodes, command)}, indent=2))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
