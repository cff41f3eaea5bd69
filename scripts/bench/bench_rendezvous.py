#!/usr/bin/env python
"""Rendezvous at scale: N simulated agents against one real etcd, no workers.

Each simulated agent is a thread running the real protocol (see ``rendezvous_agents.py``);
the agents are sharded over a few child processes. Three phases per node count, each timed
from the command to the moment every live agent holds the new round:

- ``round 0``: every agent registers and the first round forms (``--nnodes N-1:N``, so it
  forms as soon as all N wait);
- ``loss``: one agent dies like a SIGKILLed node (its keep-alive stops; etcd expires its
  lease after ``--heartbeat`` s) and the survivors re-form without it (``re-form``: from when the
  leader saw the loss — the time in its end record — to every survivor holding the new round;
  ``formed``: from the command to the leader writing the round's record);
- ``join``: a new agent starts and the round re-forms with it (after the 0.5 s stability window).

Per phase: the time, the agents' CPU per agent, etcd's CPU, the writes etcd committed
(revisions), the watch events etcd sent, and per agent the watch events its view received,
its loop turns and its etcd requests. These are simulated agents on one machine: a real
cluster runs one agent per machine, with its own CPU.

``--clients``: ``agent`` gives every simulated agent its own etcd client (gRPC channel, watch
stream), like real nodes; ``process`` one client per process, a view per agent; ``shared``
also one view (one watch) per process.

etcd (started here) runs at nice -10 where the bench may raise it (root or CAP_SYS_NICE; the header
says), the keep-alive helpers at -5, the agents at ``SCHED_IDLE``: see :func:`raise_priority`.
A real agent also reads each round's record, which a process's agents share here: the bench ends
with that read's size and CPU per node count (``--record-only``: just that).

    python scripts/bench/bench_rendezvous.py --clients shared --nodes 256 1024 4096
    python scripts/bench/bench_rendezvous.py --clients agent --nodes 8 32 128 256 --runs 1 --json
    python scripts/bench/bench_rendezvous.py --clients shared --nodes 4096 --ramp 20
    python scripts/bench/bench_rendezvous.py --record-only --nodes 256 1024 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional

from etcd_metrics import etcd_counters  # a sibling file of this script
from rendezvous_counts import COUNTERS, MAXIMA  # noqa: E402 - the children's counters (a sibling file of this script)

from elasticrun.job.keys import JobKeys

os.environ.setdefault("OMP_NUM_THREADS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "rendezvous_agents.py")
PHASES = ("loss", "join")
ETCD_NICE = -10  # see raise_priority
# --clients agent: a gRPC channel and its threads per agent; more agents per process queue their threads
# for the process's GIL (keep-alives then wait seconds), so they are spread over more processes.
AGENTS_PER_PROC = 32


class Children:
    """The child processes of one run and the commands to them."""

    def __init__(self, endpoint: str, nodes: int, procs: int, heartbeat: float, clients: str,
                 profile: str, ramp: float = 0.0) -> None:
        job = self.job = f"bench-{nodes}-{uuid.uuid4().hex[:6]}"
        procs = max(1, min(procs, nodes))
        self.procs = []
        first = 0
        for p in range(procs):
            count = nodes // procs + (1 if p < nodes % procs else 0)
            cmd = [sys.executable, CHILD, endpoint, job, str(nodes), str(first), str(count), str(heartbeat), clients,
                   profile, str(ramp)]
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            first += count
        for c in self.procs:
            line = c.stdout.readline()  # type: ignore[union-attr]
            if line.strip() != "ready":
                raise RuntimeError(f"a child failed to start: {line!r}")

    def send(self, line: str, procs: Optional[List[Any]] = None, answer: bool = True) -> List[Dict[str, Any]]:
        procs = self.procs if procs is None else procs
        for c in procs:
            c.stdin.write(line + "\n")  # type: ignore[union-attr]
            c.stdin.flush()  # type: ignore[union-attr]
        if not answer:
            return []
        out = []
        for c in procs:
            reply = c.stdout.readline()  # type: ignore[union-attr]
            if not reply:
                raise RuntimeError("a child died")
            out.append(json.loads(reply))
        return out

    def close(self) -> None:
        try:
            self.send("leave")
        except (RuntimeError, OSError, ValueError):
            pass
        for c in self.procs:
            try:
                c.wait(30)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()


def phase(children: Children, endpoint: str, name: str, target: int, start_cmd: str, nodes: int,
          timeout: float) -> Dict[str, Any]:
    """Run one phase: send ``start_cmd``, wait until every live agent holds round ``target``."""
    before = etcd_counters(endpoint)
    t0 = time.time()
    if start_cmd == "go":
        children.send("go", answer=False)
    elif start_cmd.startswith("kill"):
        if not any(r["killed"] for r in children.send(start_cmd)):
            raise RuntimeError(f"no child had the agent of {start_cmd!r}")
    else:
        children.send(start_cmd, children.procs[-1:])
    replies = children.send(f"wait {target} {timeout}")
    after = etcd_counters(endpoint)
    held = [t for r in replies for t in r["held"].values()]
    errors = [e for r in replies for e in r["errors"]]
    missing = sum(1 for t in held if t is None)
    got = [t for t in held if t is not None] or [t0]
    agents = len(held)
    row: Dict[str, Any] = {
        "phase": name, "nodes": nodes, "agents": agents, "round": target,
        "all_hold_s": max(got) - t0, "first_holds_s": min(got) - t0,
        "agents_cpu_s": sum(r["cpu_s"] for r in replies),
    }
    row["cpu_per_agent_ms"] = 1000 * row["agents_cpu_s"] / agents
    if name == "round 0":
        row["all_round_s"] = row["all_hold_s"]  # the name scripts/perf charts read
    for k in COUNTERS:
        row[k] = sum(r[k] for r in replies)
    for k in MAXIMA:
        row[k] = max(r.get(k, 0.0) for r in replies)
    for k in ("watch_events", "loop_turns", "etcd_requests"):
        row[f"{k}_per_agent"] = row[k] / agents
    if before and after:
        row["etcd_cpu_s"] = after["cpu_s"] - before["cpu_s"]
        row["etcd_writes"] = int(after["revision"] - before["revision"])
        row["etcd_proposals"] = int(after.get("proposals", 0) - before.get("proposals", 0))
        row["etcd_events_sent"] = int(after["events_sent"] - before["events_sent"])
        row["etcd_requests"] = int(after["requests"] - before["requests"])
        row["etcd_db_bytes"] = int(after["db_bytes"])
    formed = formed_at(endpoint, children.job, target)
    if formed is not None:  # the round record written: what comes after is every agent seeing it
        row["formed_s"] = formed - t0
    if start_cmd.startswith("kill"):  # when the leader saw the lost node (etcd expired its lease): the
        ended = ended_at(endpoint, children.job, target - 1)  # rest of the phase is the re-form itself
        if ended is not None:
            row["noticed_s"] = ended - t0
            row["reform_s"] = row["all_hold_s"] - row["noticed_s"]
    if missing or errors:  # the row still says how far it got and how the keep-alives fared
        row["failed"] = f"{missing} of {agents} agents never held round {target}"
        row["errors"] = (errors + [e for r in replies for e in r.get("ka_errors", [])])[:5]
    return row


def read_json(endpoint: str, key: str) -> Dict[str, Any]:
    """The record at ``key`` ({} when absent or not an object), read with a client of its own."""
    from elasticrun.store.client import connect

    store = connect(endpoint)
    try:
        return store.get_json(key) or {}
    finally:
        store.close()


def ended_at(endpoint: str, job: str, round_: int) -> Optional[float]:
    """When the leader ended round ``round_`` (the ``time`` of its end record; None when absent)."""
    at = read_json(endpoint, JobKeys(job).end(round_)).get("time")
    return float(at) if isinstance(at, (int, float)) else None


def formed_at(endpoint: str, job: str, round_: int) -> Optional[float]:
    """When the leader wrote round ``round_``'s record (its ``created_at``; None when another round is there)."""
    topo = read_json(endpoint, JobKeys(job).topology)
    at = topo.get("created_at") if topo.get("round") == round_ else None
    return float(at) if isinstance(at, (int, float)) else None


def newest_round(endpoint: str, job: str) -> int:
    """The round of the job's round record (-1 when none is written)."""
    round_ = read_json(endpoint, JobKeys(job).topology).get("round")
    return round_ if isinstance(round_, int) else -1


def run_once(endpoint: str, nodes: int, procs: int, heartbeat: float, clients: str, phases: List[str],
             profile: str = "", ramp: float = 0.0) -> Iterator[Dict[str, Any]]:
    """The phases of one run of ``nodes`` agents; one row per phase, as each ends."""
    children = Children(endpoint, nodes, procs, heartbeat, clients, profile, ramp)
    timeout = 60 + nodes * 0.05
    try:
        row = phase(children, endpoint, "round 0", 0, "go", nodes, timeout)
        yield row
        # Each phase waits for the round after the newest one (agents that lost their lease and rejoined
        # may have re-formed the job more than once in the phase before).
        if "loss" in phases and "failed" not in row:
            row = phase(children, endpoint, "loss", newest_round(endpoint, children.job) + 1, f"kill {nodes // 2}",
                        nodes, timeout + heartbeat)
            yield row
        if "join" in phases and "failed" not in row:
            yield phase(children, endpoint, "join", newest_round(endpoint, children.job) + 1, f"join {nodes}", nodes,
                        timeout)
    finally:
        children.close()


def record_parse(nodes: int) -> Dict[str, Any]:
    """What every real agent does once per round on top of what the shared view does once per process:
    read the round record of ``nodes`` members (``parse_topology``). Its size and the CPU of one parse."""
    from elasticrun.rendezvous.records import Member, Topology, parse_topology

    members = tuple(Member(f"node-{i:05d}", f"host-{i:05d}.cluster.local", f"10.{i >> 16}.{(i >> 8) & 255}.{i & 255}",
                           8, i, 8 * i, 0x51CFA21CCE224806 + i) for i in range(nodes))
    record = json.dumps(Topology(round=1, members=members, master_addr="10.0.0.1", master_port=29500).to_dict())
    parse_topology(record)
    runs, t0 = 0, time.process_time()
    while runs < 3 or time.process_time() - t0 < 0.5:
        parse_topology(record)
        runs += 1
    return {"nodes": nodes, "record_bytes": len(record), "parse_ms": (time.process_time() - t0) / runs * 1e3}


def summary_rows(rows: List[Dict[str, Any]], sizes: List[int], command: str) -> List[Dict[str, Any]]:
    """The preamble's ``summary``: median time to round 0 per size against the linear target."""
    out: List[Dict[str, Any]] = []
    for n in sizes:
        mine = [r["all_hold_s"] for r in rows if r["nodes"] == n and r["phase"] == "round 0" and "failed" not in r]
        if not mine:
            continue
        med = statistics.median(mine)
        target = max(1.0, 5.0 * n / 256)
        out.append({
            "metric": f"rendezvous of {n} agents (simulated) -> all hold round 0", "elasticrun": med,
            "alternative": "target (5 s at 256 agents, linear)", "alt_value": target, "unit": "s",
            "better": "lower", "ratio": target / med if med > 0 else 0.0, "device": "cpu", "command": command,
        })
    return out


HEADER = (f"{'nodes':>6} {'phase':>8} {'all hold':>9} {'CPU/agent':>10} {'etcd CPU':>9} {'writes':>7} {'raft':>7} "
          f"{'etcd reqs':>9} {'ev sent':>8} {'ev/agent':>9} {'turns/agent':>12} {'reqs/agent':>11} {'CAS lost':>8} "
          f"{'rejoins':>7} {'retries':>7} {'KA batch':>8} {'KA gap':>7} {'KA age':>7} {'formed':>7} {'re-form':>8}")


def format_row(r: Dict[str, Any]) -> str:
    if "failed" in r:
        return (f"{r['nodes']:>6} {r['phase']:>8} FAILED: {r['failed']} (keep-alive batch up to "
                f"{r['ka_batch_max_s']:.1f} s, a lease waited up to {r['ka_gap_max_s']:.1f} s between two and went "
                f"unconfirmed up to {r['ka_age_max_s']:.1f} s; {r['keepalives_failed']} failed; "
                f"{r['rejoins']} rejoins, {r['etcd_retries']} retried etcd errors); "
                + "; ".join(r["errors"][:3]))
    return (f"{r['nodes']:>6} {r['phase']:>8} {r['all_hold_s']:>8.2f}s {r['cpu_per_agent_ms']:>8.1f}ms "
            f"{r.get('etcd_cpu_s', 0):>8.2f}s {r.get('etcd_writes', 0):>7} {r.get('etcd_proposals', 0):>7} "
            f"{r.get('etcd_requests', 0):>9} "
            f"{r.get('etcd_events_sent', 0):>8} {r['watch_events_per_agent']:>9.1f} {r['loop_turns_per_agent']:>12.1f} "
            f"{r['etcd_requests_per_agent']:>11.1f} {r['cas_lost']:>8} {r['rejoins']:>7} {r['etcd_retries']:>7} "
            f"{r['ka_batch_max_s']:>7.2f}s "
            f"{r['ka_gap_max_s']:>6.2f}s {r['ka_age_max_s']:>6.2f}s "
            + (f"{r['formed_s']:>6.2f}s " if "formed_s" in r else f"{'-':>7} ")
            + (f"{r['reform_s']:>7.2f}s" if "reform_s" in r else f"{'-':>8}"))


def raise_priority(pid: int, nice: int) -> bool:
    """Every thread of process ``pid`` at ``nice`` (below 0 needs root or CAP_SYS_NICE; False if refused).

    The simulated agents run at ``SCHED_IDLE`` so that etcd is not starved by its own clients'
    simulation, but the scheduler weighs each runnable thread: a thousand agents' threads at the idle
    weight (3) together outweigh etcd's few threads at nice 0 (1,024 each). On a real cluster etcd
    has machines of its own.
    """
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):  # Linux: a nice value is per thread; new ones inherit it
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    except (OSError, ValueError):
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 128, 256])
    ap.add_argument("--procs", type=int, default=0,
                    help="child processes the agents are sharded over (default: 4; with --clients agent, one per "
                    f"{AGENTS_PER_PROC} agents, at least 4)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--clients", choices=["agent", "process", "shared"], default="agent",
                    help="agent: an etcd client per simulated agent, like real nodes; process: one client per "
                    "process, a view per agent; shared: one client and one view (watch) per process")
    ap.add_argument("--phases", nargs="*", choices=PHASES, default=list(PHASES),
                    help="after round 0 (always): loss: one node dies; join: one node joins")
    ap.add_argument("--heartbeat", type=float, default=10.0, help="lease TTL of the simulated agents")
    ap.add_argument("--ramp", type=float, default=0.0, metavar="S",
                    help="round 0's agents start spread evenly over S seconds after go, as the nodes of a real job "
                    "start over seconds (default 0: all at once); the time is still counted from go")
    ap.add_argument("--endpoint", default="", help="use this etcd instead of starting one")
    ap.add_argument("--no-fsync", action="store_true",
                    help="start etcd with --unsafe-no-fsync (a disk whose fsyncs stall for seconds under load "
                         "is then not what is measured; a real etcd has a disk of its own)")
    ap.add_argument("--profile", default="", metavar="DIR",
                    help="cProfile every child's threads; one marshalled pstats file per child and phase in DIR")
    ap.add_argument("--record-only", action="store_true",
                    help="only measure reading the round record of each --nodes size (no etcd, no agents)")
    ap.add_argument("--json", action="store_true", help="print the raw rows as JSON too")
    ap.add_argument("--out", default="", metavar="FILE",
                    help="also write the rows as JSON to FILE (scripts/perf/plot_rendezvous.py draws them)")
    args = ap.parse_args()
    if args.record_only:
        print(json.dumps([record_parse(n) for n in args.nodes]))
        return
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)

    from elasticrun.store.server import EtcdServer

    server = None
    endpoint = args.endpoint
    raised = False
    if not endpoint:
        server = EtcdServer(unsafe_no_fsync=args.no_fsync).start()
        endpoint = server.endpoint
        raised = server.proc is not None and raise_priority(server.proc.pid, ETCD_NICE)
    rows: List[Dict[str, Any]] = []
    try:
        load = os.getloadavg()[0]
        print(f"etcd {endpoint}; {os.cpu_count()} CPUs, load {load:.1f}; simulated agents over {args.procs or 'auto'} "
              f"processes; --clients {args.clients}; heartbeat {args.heartbeat:g} s; ramp {args.ramp:g} s"
              + ("" if args.endpoint else f"; etcd at nice {ETCD_NICE if raised else 0}"
                 + (", without fsync" if args.no_fsync else "")))
        print(HEADER)
        for n in args.nodes:
            for _ in range(args.runs):
                procs = args.procs or (max(4, -(-n // AGENTS_PER_PROC)) if args.clients == "agent" else 4)
                for r in run_once(endpoint, n, procs, args.heartbeat, args.clients, args.phases, args.profile,
                                  args.ramp):
                    r["load"], r["procs"] = os.getloadavg()[0], procs
                    rows.append(r)
                    print(format_row(r), flush=True)
        parses = [record_parse(n) for n in args.nodes]
        print("a real agent also reads each round's record (shared here by a process's agents): " + ", ".join(
            f"{p['nodes']} members {p['record_bytes'] / 1e3:.0f} KB {p['parse_ms']:.1f} ms" for p in parses))
        command = " ".join(["python", "scripts/bench/bench_rendezvous.py", *sys.argv[1:]])
        result = {"rows": rows, "summary": summary_rows(rows, args.nodes, command), "command": command,
                  "cpus": os.cpu_count(), "load_at_start": load, "record_parse": parses}
        if args.json:
            print(json.dumps(result, indent=2))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
