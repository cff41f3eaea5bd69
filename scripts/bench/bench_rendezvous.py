#!/usr/bin/env python
"""Rendezvous at scale: N simulated agents against one real etcd, no workers.

    python scripts/bench/bench_rendezvous.py --clients shared --nodes 64 256 1024 --runs 1
    python scripts/bench/bench_rendezvous.py --record-only --nodes 256 1024 4096

Each simulated agent runs the agent's own loop (``rendezvous_agents.py``), sharded over child processes. Per node
count three phases, each timed from the command until every live agent holds the new round: ``round 0``, ``loss``
(one agent dies as a SIGKILLed node) and ``join`` (one agent joins), with the agents' CPU and loop turns and etcd's
own counters (docs/performance.md, "Rendezvous"). etcd runs at nice -10 where the bench may raise it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional

from common import shown_command, summary_row, write_json  # sibling files of this script
from etcd_metrics import etcd_counters

from elasticrun.job.keys import JobKeys
from elasticrun.store.client import EtcdStore, connect

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rendezvous_agents.py")
PROCS = 4  # child processes the agents are sharded over
ETCD = {"etcd_cpu_s": "cpu_s", "etcd_writes": "revision", "etcd_proposals": "proposals",
        "etcd_events_sent": "events_sent", "etcd_requests": "requests"}


class Children:
    """The child processes of one run and the commands to them."""

    def __init__(self, endpoint: str, nodes: int, heartbeat: float) -> None:
        self.job = f"bench-{nodes}-{uuid.uuid4().hex[:6]}"
        self.procs, first = [], 0
        for p in range(min(PROCS, nodes)):
            count = nodes // PROCS + (1 if p < nodes % PROCS else 0)
            cmd = [sys.executable, CHILD, endpoint, self.job, str(nodes), str(first), str(count), str(heartbeat)]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            first += count
        for c in self.procs:
            if c.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise RuntimeError("a child failed to start")

    def send(self, line: str, procs: Optional[List[Any]] = None) -> List[Dict[str, Any]]:
        """Send the command ``line`` to ``procs`` (default: every child); their answers."""
        procs = self.procs if procs is None else procs
        for c in procs:
            c.stdin.write(line + "\n")  # type: ignore[union-attr]
            c.stdin.flush()  # type: ignore[union-attr]
        replies = [c.stdout.readline() for c in procs]  # type: ignore[union-attr]
        if not all(replies):
            raise RuntimeError("a child died")
        return [json.loads(r) for r in replies]

    def start(self, start: str) -> None:
        """``go`` or ``kill I`` to every child (one has agent I), ``join I`` to the last one."""
        replies = self.send(start, self.procs[-1:] if start.startswith("join") else None)
        if start.startswith("kill") and not any(r["killed"] for r in replies):
            raise RuntimeError(f"no child had the agent of {start!r}")

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            self.send("leave")
        for c in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.wait(30)
            c.kill()  # nothing when it exited
            c.wait()


def phase(children: Children, store: EtcdStore, name: str, start: str, nodes: int, timeout: float) -> Dict[str, Any]:
    """Run one phase: send ``start``, wait until every live agent holds the round after the newest one."""
    keys = JobKeys(children.job)
    target = (store.get_json(keys.topology) or {}).get("round", -1) + 1  # rejoins may have re-formed more than once
    before, t0 = etcd_counters(store.endpoints), time.time()
    children.start(start)
    replies = children.send(f"wait {target} {timeout}")
    row = {"phase": name, "nodes": nodes, "round": target, **agents_row(replies, t0)}
    after = etcd_counters(store.endpoints)
    if before and after:
        row.update({k: after[v] - before[v] for k, v in ETCD.items()})
        row["requests_per_agent"] = row["etcd_requests"] / row["agents"]
        row["events_per_agent"] = row["etcd_events_sent"] / row["agents"]
    topo = store.get_json(keys.topology) or {}
    if topo.get("round") == target:  # when the leader wrote the round; the rest is every agent seeing it
        row["formed_s"] = float(topo["created_at"]) - t0
    noticed = (store.get_json(keys.end(target - 1)) or {}).get("time") if start.startswith("kill") else None
    if isinstance(noticed, (int, float)):  # when the leader saw the lost node: the rest is the re-form itself
        row["noticed_s"] = noticed - t0
        row["reform_s"] = row["all_hold_s"] - row["noticed_s"]
    return row


def agents_row(replies: List[Dict[str, Any]], t0: float) -> Dict[str, Any]:
    """What the children's answers to ``wait`` say: when every agent held the round, CPU, counts, failures."""
    held = [t for r in replies for t in r["held"].values()]
    got = [t for t in held if t is not None] or [t0]
    row: Dict[str, Any] = {"agents": len(held), "all_hold_s": max(got) - t0,
                           "agents_cpu_s": sum(r["cpu_s"] for r in replies)}
    row["cpu_per_agent_ms"] = 1000 * row["agents_cpu_s"] / len(held)
    row.update({k: sum(r[k] for r in replies) for k in ("loop_turns", "rejoins", "etcd_waits")})
    row["turns_per_agent"] = row["loop_turns"] / len(held)
    missing, errors = held.count(None), [e for r in replies for e in r["errors"]]
    if missing or errors:
        row.update(failed=f"{missing} of {len(held)} agents never held the round", errors=errors[:5])
    return row


def run_once(store: EtcdStore, nodes: int, heartbeat: float, phases: List[str]) -> Iterator[Dict[str, Any]]:
    """Round 0 and ``phases`` of one run of ``nodes`` agents; one row per phase, as each ends (none after a failure)."""
    children = Children(store.endpoints, nodes, heartbeat)
    timeout = 60 + nodes * 0.05
    try:
        for name, start, limit in (("round 0", "go", timeout), ("loss", f"kill {nodes // 2}", timeout + heartbeat),
                                   ("join", f"join {nodes}", timeout)):
            if name != "round 0" and name not in phases:
                continue
            row = phase(children, store, name, start, nodes, limit)
            yield row
            if "failed" in row:
                return
    finally:
        children.close()


def record_parse(nodes: int) -> Dict[str, Any]:
    """What every agent does once per round: read the round record of ``nodes`` members (its size, and the
    CPU of one ``parse_topology``)."""
    from elasticrun.rendezvous.records import Member, Topology, parse_topology

    members = tuple(Member(f"node-{i:05d}", f"host-{i:05d}.cluster.local", f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}",
                           8, i, 8 * i, 0x51CFA21CCE224806 + i) for i in range(nodes))
    record = json.dumps(Topology(round=1, members=members, master_addr="10.0.0.1", master_port=29500).to_dict())
    t0 = time.process_time()
    for _ in range(5):
        parse_topology(record)
    return {"nodes": nodes, "record_bytes": len(record), "parse_ms": (time.process_time() - t0) / 5 * 1e3}


def summary_rows(rows: List[Dict[str, Any]], sizes: List[int], command: str) -> List[Dict[str, Any]]:
    """The ``summary`` of the JSON output: median time to round 0 per size against the linear target."""
    out = []
    for n in sizes:
        times = [r["all_hold_s"] for r in rows if r["nodes"] == n and r["phase"] == "round 0" and "failed" not in r]
        if times:
            out.append(summary_row(f"rendezvous of {n} agents (simulated) -> all hold round 0",
                                   statistics.median(times), "target (5 s at 256 agents, linear)",
                                   max(1.0, 5.0 * n / 256), command=command))
    return out


COLUMNS = (("all hold", "all_hold_s", "{:.2f}s"), ("formed", "formed_s", "{:.2f}s"),
           ("re-form", "reform_s", "{:.2f}s"), ("CPU/agent", "cpu_per_agent_ms", "{:.1f}ms"),
           ("turns/agent", "turns_per_agent", "{:.1f}"), ("etcd CPU", "etcd_cpu_s", "{:.2f}s"),
           ("writes", "etcd_writes", "{:.0f}"), ("raft", "etcd_proposals", "{:.0f}"),
           ("reqs/agent", "requests_per_agent", "{:.1f}"), ("ev/agent", "events_per_agent", "{:.1f}"),
           ("rejoins", "rejoins", "{}"), ("etcd waits", "etcd_waits", "{}"))


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
    from elasticrun.store.server import EtcdServer

    server = EtcdServer(unsafe_no_fsync=args.no_fsync).start()
    endpoint = server.endpoint
    raised = server.proc is not None and raise_priority(server.proc.pid, -10)
    rows: List[Dict[str, Any]] = []
    store = connect(endpoint)
    try:
        load = os.getloadavg()[0]
        print(f"etcd {endpoint}{' at nice -10' if raised else ''}; {os.cpu_count()} CPUs, load {load:.1f}; "
              f"agents over {PROCS} processes (--clients shared); heartbeat {args.heartbeat:g} s")
        print(f"{'nodes':>6} {'phase':>8} " + " ".join(f"{t:>{max(8, len(t))}}" for t, _, _ in COLUMNS))
        for n in args.nodes:
            for _ in range(args.runs):
                for r in run_once(store, n, args.heartbeat, args.phases):
                    r["load"] = os.getloadavg()[0]
                    rows.append(r)
                    print(format_row(r), flush=True)
        print("every agent also reads each round's record: " + ", ".join(
            f"{p['nodes']} members {p['record_bytes'] / 1e3:.0f} KB {p['parse_ms']:.1f} ms" for p in parses))
        command = shown_command(__file__)
        result = {"rows": rows, "summary": summary_rows(rows, args.nodes, command), "command": command,
                  "cpus": os.cpu_count(), "load_at_start": load, "record_parse": parses}
        if args.out:
            write_json(args.out, result)
    finally:
        store.close()
        server.stop()


if __name__ == "__main__":
    main()
