"""Rendezvous at scale: N simulated agents against one real etcd, no workers.

    python scripts/bench/bench_rendezvous.py --clients shared --nodes 64 256 1024 --runs 1
    python scripts/bench/bench_rendezvous.py --record-only --nodes 256 1024 4096

Simulated agents (``rendezvous_agents.py``) over 4 processes; per node count ``round 0``, ``loss`` (a SIGKILLed
node) and ``join``, each timed until every live agent holds the new round (docs/performance.md, "Rendezvous").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import get_context
from multiprocessing.managers import BaseManager
from typing import Any, Callable, Dict, Iterator, List

from common import shown_command, summary_row, write_json  # sibling files of this script
from etcd_metrics import etcd_counters
from rendezvous_agents import COUNTS, Shard

from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.records import Member, Topology, parse_topology
from elasticrun.store.client import EtcdStore, connect
from elasticrun.store.server import EtcdServer

PROCS = 4  # child processes the agents are sharded over
ETCD = {"etcd_cpu_s": "cpu_s", "etcd_writes": "revision", "etcd_proposals": "proposals",
        "etcd_events_sent": "events_sent", "etcd_requests": "requests"}
COLUMNS = (("all hold", "all_hold_s", "{:.2f}s"), ("formed", "formed_s", "{:.2f}s"),
           ("re-form", "reform_s", "{:.2f}s"), ("CPU/agent", "cpu_per_agent_ms", "{:.1f}ms"),
           ("turns/agent", "turns_per_agent", "{:.1f}"), ("etcd CPU", "etcd_cpu_s", "{:.2f}s"),
           ("writes", "etcd_writes", "{:.0f}"), ("raft", "etcd_proposals", "{:.0f}"),
           ("reqs/agent", "requests_per_agent", "{:.1f}"), ("ev/agent", "events_per_agent", "{:.1f}"),
           ("rejoins", "rejoins", "{}"), ("etcd waits", "etcd_waits", "{}"))


class Shards(BaseManager):
    """Runs each :class:`rendezvous_agents.Shard` in a process of its own."""


Shards.register("Shard", Shard)


class Children:
    """``nodes`` agents sharded over ``PROCS`` processes."""

    def __init__(self, endpoint: str, nodes: int, heartbeat: float) -> None:
        self.job = f"bench-{nodes}-{uuid.uuid4().hex[:6]}"
        self.managers = [Shards(ctx=get_context("spawn")) for _ in range(min(PROCS, nodes))]
        self.shards: List[Any] = []
        for p, m in enumerate(self.managers):
            m.start()
            self.shards.append(m.Shard(endpoint, self.job, nodes, heartbeat, list(range(p, nodes, PROCS))))

    def each(self, call: Callable[[Any], Any]) -> List[Any]:
        """``call(shard)`` on every shard at once; their answers."""
        with ThreadPoolExecutor(len(self.shards)) as pool:
            return list(pool.map(call, self.shards))

    def close(self) -> None:
        with contextlib.suppress(Exception):  # the agents leave the job; the processes end in any case
            self.each(lambda s: s.leave())
        for m in self.managers:
            m.shutdown()


def phase(children: Children, store: EtcdStore, name: str, nodes: int, timeout: float) -> Dict[str, Any]:
    """Run one phase (``round 0``, ``loss``: agent N/2 dies, ``join``: agent N joins) until every live agent holds
    the round after the newest one; its row."""
    keys = JobKeys(children.job)
    target = (store.get_json(keys.topology) or {}).get("round", -1) + 1  # rejoins may have re-formed more than once
    before, t0 = etcd_counters(store.endpoints), time.time()
    if name == "round 0":
        children.each(lambda s: s.go())
    elif name == "loss" and not any(children.each(lambda s: s.kill(nodes // 2))):
        raise RuntimeError(f"no shard had agent {nodes // 2}")
    elif name == "join":
        children.shards[-1].start(nodes)
    row = phase_row(name, nodes, target, t0, children.each(lambda s: s.wait(target, timeout)))
    after = etcd_counters(store.endpoints)
    if before and after:
        row.update({k: after[v] - before[v] for k, v in ETCD.items()})
        row.update(requests_per_agent=row["etcd_requests"] / row["agents"],
                   events_per_agent=row["etcd_events_sent"] / row["agents"])
    topo = store.get_json(keys.topology) or {}
    if topo.get("round") == target:  # when the leader wrote the round; the rest is every agent seeing it
        row["formed_s"] = float(topo["created_at"]) - t0
    noticed = (store.get_json(keys.end(target - 1)) or {}).get("time") if name == "loss" else None
    if isinstance(noticed, (int, float)):  # when the leader saw the lost node: the rest is the re-form itself
        row["noticed_s"] = noticed - t0
        row["reform_s"] = row["all_hold_s"] - row["noticed_s"]
    return row


def phase_row(name: str, nodes: int, target: int, t0: float, replies: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A phase's row from the shards' replies: when every agent held the round, their CPU and counts, failures."""
    held = [t for r in replies for t in r["held"].values()]
    row: Dict[str, Any] = {"phase": name, "nodes": nodes, "round": target, "agents": len(held),
                           "all_hold_s": max([t for t in held if t is not None] or [t0]) - t0,
                           "agents_cpu_s": sum(r["cpu_s"] for r in replies)}
    row.update({k: sum(r[k] for r in replies) for k in COUNTS})
    row.update(cpu_per_agent_ms=1000 * row["agents_cpu_s"] / len(held), turns_per_agent=row["loop_turns"] / len(held))
    errors = [e for r in replies for e in r["errors"]]
    if None in held or errors:
        row.update(failed=f"{held.count(None)} of {len(held)} agents never held the round", errors=errors[:5])
    return row


def run_once(store: EtcdStore, nodes: int, heartbeat: float, phases: List[str]) -> Iterator[Dict[str, Any]]:
    """Round 0 and ``phases`` of one run of ``nodes`` agents; one row per phase, as each ends (none after a failure)."""
    children = Children(store.endpoints, nodes, heartbeat)
    timeout = 60 + nodes * 0.05
    try:
        for name in ("round 0", *(p for p in ("loss", "join") if p in phases)):
            row = phase(children, store, name, nodes, timeout + (heartbeat if name == "loss" else 0))
            yield row
            if "failed" in row:
                return
    finally:
        children.close()


def record_parse(nodes: int) -> Dict[str, Any]:
    """What every agent does once per round: read the round record of ``nodes`` members (its size, and the
    CPU of one ``parse_topology``)."""
    members = tuple(Member(f"node-{i:05d}", f"host-{i:05d}.cluster.local", f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}",
                           8, i, 8 * i, 0x51CFA21CCE224806 + i) for i in range(nodes))
    record = json.dumps(Topology(round=1, members=members, master_addr="10.0.0.1", master_port=29500).to_dict())
    t0 = time.process_time()
    for _ in range(5):
        parse_topology(record)
    return {"nodes": nodes, "record_bytes": len(record), "parse_ms": (time.process_time() - t0) / 5 * 1e3}


def format_row(r: Dict[str, Any]) -> str:
    cells = [f"{r['nodes']:>6} {r['phase']:>8}"] + [
        f"{fmt.format(r[key]) if key in r else '-':>{max(8, len(title))}}" for title, key, fmt in COLUMNS]
    return " ".join(cells) + (f"  FAILED: {r['failed']}; " + "; ".join(r["errors"][:3]) if "failed" in r else "")


def raise_priority(pid: int, nice: int) -> bool:
    """Every thread of process ``pid`` at ``nice`` (below 0 needs root or CAP_SYS_NICE; False if refused)."""
    with contextlib.suppress(OSError, ValueError):
        for tid in os.listdir(f"/proc/{pid}/task"):  # Linux: a nice value is per thread; new ones inherit it
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        return True
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 128, 256])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--clients", choices=["shared"], default="shared",
                    help="the agents of a process share one etcd client and one job view (watch)")
    ap.add_argument("--heartbeat", type=float, default=10.0, help="lease TTL of the simulated agents")
    ap.add_argument("--phases", nargs="*", choices=["loss", "join"], default=["loss", "join"],
                    help="after round 0 (always): loss: one node dies; join: one node joins")
    ap.add_argument("--no-fsync", action="store_true", help="start etcd with --unsafe-no-fsync")
    ap.add_argument("--record-only", action="store_true", help="only measure reading the round record per size")
    ap.add_argument("--out", default="", metavar="FILE", help="also write the rows as JSON to FILE "
                    "(scripts/perf/perf_report.py --rendezvous FILE draws them)")
    args = ap.parse_args()
    parses = [record_parse(n) for n in args.nodes]
    if args.record_only:
        print(json.dumps(parses))
        return
    rows: List[Dict[str, Any]] = []
    with EtcdServer(unsafe_no_fsync=args.no_fsync) as server, contextlib.closing(connect(server.endpoint)) as store:
        raised = server.proc is not None and raise_priority(server.proc.pid, -10)
        load = os.getloadavg()[0]
        print(f"etcd {server.endpoint}{' at nice -10' if raised else ''}; {os.cpu_count()} CPUs, load {load:.1f}; "
              f"agents over {PROCS} processes (--clients shared); heartbeat {args.heartbeat:g} s")
        print(f"{'nodes':>6} {'phase':>8} " + " ".join(f"{t:>{max(8, len(t))}}" for t, _, _ in COLUMNS))
        for n in args.nodes:
            for _ in range(args.runs):
                for r in run_once(store, n, args.heartbeat, args.phases):
                    rows.append(dict(r, load=os.getloadavg()[0]))
                    print(format_row(r), flush=True)
    print("every agent also reads each round's record: " + ", ".join(
        f"{p['nodes']} members {p['record_bytes'] / 1e3:.0f} KB {p['parse_ms']:.1f} ms" for p in parses))
    command = shown_command(__file__)
    summary = []
    for n in args.nodes:  # the median time to round 0 per size against the linear target
        times = [r["all_hold_s"] for r in rows if r["nodes"] == n and r["phase"] == "round 0" and "failed" not in r]
        if times:
            summary.append(summary_row(f"rendezvous of {n} agents (simulated) -> all hold round 0",
                                       statistics.median(times), "target (5 s at 256 agents, linear)",
                                       max(1.0, 5.0 * n / 256), command=command))
    write_json(args.out, {"rows": rows, "summary": summary, "command": command, "cpus": os.cpu_count(),
                          "load_at_start": load, "record_parse": parses})


if __name__ == "__main__":
    main()
