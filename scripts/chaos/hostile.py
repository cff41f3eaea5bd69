"""The chaos soak's faults from outside the job: a malformed record in its etcd prefix, a burst of slow
clients on an agent's metrics port, and a job id reused right after its job ends.

- ``bad_record``: one record of the running job is overwritten with something that is not what the agents
  expect (truncated JSON, a list for an object, a string for a number, an unknown state, a leader key on no
  lease). The job must train on; every agent that read it says so once (which key, what was wrong), never
  twice, and none exits; ``elasticrun status --json`` still shows the job. The record is removed again at the
  fault's end (unless the job rewrote it meanwhile).
- ``slow_metrics``: ~100 connections to one agent's ``--metrics-port`` each send half an HTTP request and
  stall for the fault's duration. The job must train on; whether a well-behaved scrape still answered meanwhile
  is noted (the soak never waits on the endpoint longer than a few seconds).
- ``job_reuse``: a short side job (one node) under its own id runs to its end; the moment its agent exits,
  a job with other arguments is started under the same id, as a scheduler resubmits an edited job. It must
  start from its first round, run its script with its own arguments and exit 0; both leave their keys on the
  expiry lease.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from elasticrun.job.keys import JobKeys
from elasticrun.store.types import Guard

if TYPE_CHECKING:
    from .faults import Fault
    from .soak import Soak

NOTICE = "ignoring a malformed record in etcd at "
SLOW_CLIENTS = 100
SCRAPE_WAIT_S = 5.0
REUSE_TIMEOUT_S = 120.0
# A record the agents read while a round runs, and a malformed value for it. The key comes from the job's
# keys, its current round and one of its nodes.
BAD_RECORDS: List[Tuple[str, Callable[[JobKeys, int, str], str], bytes]] = [
    ("state: an unknown end", lambda k, r, n: k.state, b'{"state": 5, "reason": "written by hand"}'),
    ("failure flag: a list", lambda k, r, n: k.failed(r), b"[1, 2, 3]"),
    ("end flag: truncated JSON", lambda k, r, n: k.end(r), b'{"reason": "scale-'),
    ("node record: wrong types", lambda k, r, n: k.node("chaos-foreign"), b'{"node_id": 7, "nproc": "many"}'),
    ("progress: a string step", lambda k, r, n: k.progress_of(n), b'{"step": "x", "round": 0}'),
    ("leader key: on no lease", lambda k, r, n: k.leader, b"\xffnot-a-node"),
    ("goodput: not numbers", lambda k, r, n: k.goodput_of("chaos-foreign"), b'{"wall_s": "long"}'),
    ("rescale event: not UTF-8", lambda k, r, n: k.event(r + 3), b"\xff\xfe\x00"),
]


def _current(store: Any, keys: JobKeys) -> Tuple[int, List[str]]:
    """The job's current round and its members (from its ``topology``)."""
    kv = store.get(keys.topology)
    try:
        topo = json.loads(kv.value) if kv is not None else {}
        return int(topo.get("round", 0)), [str(m["node_id"]) for m in topo.get("members", [])]
    except (ValueError, TypeError, KeyError, AttributeError):
        return 0, []


def _reports(soak: Soak, key: str) -> Dict[str, int]:
    """How many times each agent's log says it ignored the record at ``key``."""
    counts: Dict[str, int] = {}
    for a in soak.launcher.agents:
        try:
            text = a.log_path.read_text(errors="replace")
        except OSError:
            continue
        n = text.count(NOTICE + key + ":")
        if n:
            counts[f"slot{a.slot}.{a.incarnation}"] = n
    return counts


def bad_record(soak: Soak, f: Fault) -> None:
    """Write one malformed record into the live job's prefix (see the module doc)."""
    from elasticrun.store.client import connect

    keys = JobKeys(soak.launcher.job)
    what, key_of, value = BAD_RECORDS[int(f.pick * len(BAD_RECORDS)) % len(BAD_RECORDS)]
    with connect(soak.launcher.endpoint, retry_timeout=30) as store:
        round_, members = _current(store, keys)
        key = key_of(keys, round_, members[0] if members else "slot0.0")
        f.target = f"{what} at {key[len(keys.prefix):]}"
        rev = store.put(key, value)
        soak.sleep(max(3.0, f.duration) / 2)  # every agent's loop turns meanwhile
        _status_shows_it(soak, f)
        soak.sleep(max(3.0, f.duration) / 2)
        if store.txn([Guard(key, rev)], deletes=[key]):
            f.notes.append("removed again")
    reports = _reports(soak, key)
    twice = {agent: n for agent, n in reports.items() if n > 1}
    if twice:
        soak.violations.append(f"bad_record {key}: reported more than once by {twice} (once is the rule)")
    f.notes.append(f"reported by {len(reports)} agent(s)" if reports else "no agent read it during the fault")


def _status_shows_it(soak: Soak, f: Fault) -> None:
    """``elasticrun status --json`` of the job (it reads every record) answers with one document."""
    cmd = [sys.executable, "-m", "elasticrun", "status", "--rdzv-endpoint", soak.launcher.endpoint, "--rdzv-id",
           soak.launcher.job, "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=soak.launcher.env,
                              cwd=str(soak.launcher.code_root))
        json.loads(proc.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError) as err:
        soak.violations.append(f"bad_record ({f.target}): elasticrun status --json failed: {err}")
        return
    if proc.returncode != 0 or "Traceback" in proc.stderr:
        soak.violations.append(f"bad_record ({f.target}): elasticrun status --json exited {proc.returncode}: "
                               f"{proc.stderr.strip()[-300:]}")


def _half_request(port: int) -> Optional[socket.socket]:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=2.0)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: chaos\r\n")  # no blank line: the request never ends
        return s
    except OSError:
        return None


def _scrape(port: int) -> Optional[float]:
    """Seconds a whole GET /metrics took (None: no answer within SCRAPE_WAIT_S)."""
    started = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=SCRAPE_WAIT_S) as s:
            s.settimeout(SCRAPE_WAIT_S)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: chaos\r\nConnection: close\r\n\r\n")
            head = s.recv(64)
    except OSError:
        return None
    return time.monotonic() - started if head.startswith(b"HTTP/") else None


def slow_metrics(soak: Soak, f: Fault) -> None:
    """Hold ~100 half-sent requests open on one agent's metrics port (see the module doc)."""
    agents = [a for a in soak.launcher.live() if a.metrics_port and a.slot != soak.launcher.ns_slot]
    if not agents:
        f.skipped = "no agent serves /metrics here"
        return
    agent = agents[int(f.pick * len(agents)) % len(agents)]
    socks = [s for s in (_half_request(agent.metrics_port) for _ in range(SLOW_CLIENTS)) if s is not None]
    f.target = f"{len(socks)} stalled clients on agent slot{agent.slot}.{agent.incarnation}'s /metrics for " \
               f"{f.duration:.0f}s"
    try:
        soak.sleep(f.duration / 2)
        took = _scrape(agent.metrics_port)
        f.notes.append(f"a scrape meanwhile answered in {took:.2f}s" if took is not None
                       else f"a scrape meanwhile got no answer within {SCRAPE_WAIT_S:.0f}s")
        soak.sleep(f.duration / 2)
    finally:
        for s in socks:
            s.close()


def _side_job(soak: Soak, job: str, name: str, script: Path) -> Tuple[int, str]:
    """Run a one-node job of ``script`` to its end; (exit code, its output)."""
    log = soak.launcher.run_dir / f"reuse-{name}.log"
    cmd = [sys.executable, "-m", "elasticrun", "run", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint",
           soak.launcher.endpoint, "--rdzv-id", job, "--node-id", f"reuse-{name}", "--standby", "0", "--no-prewarm",
           "--no-snapshots", "--ended-job-ttl", "10m", "--heartbeat-timeout", f"{soak.launcher.heartbeat:g}",
           str(script), name]
    with open(log, "wb") as out:
        try:
            code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env=soak.launcher.env, cwd=str(soak.launcher.code_root),
                                  timeout=REUSE_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            code = -1
    return code, log.read_text(errors="replace")


def job_reuse(soak: Soak, f: Fault) -> None:
    """End a side job and start another with other arguments under its id at once (see the module doc)."""
    n = sum(1 for x in soak.faults if x.kind is f.kind)
    job = f"{soak.launcher.job}-reuse"
    script = soak.launcher.run_dir / "reuse_script.py"
    script.write_text("import os, sys\nprint('reuse-run', sys.argv[1], 'round', os.environ['ELASTICRUN_ROUND'])\n")
    f.target = f"job {job}: run {n}a ends, run {n}b starts under its id with other arguments"
    for name in (f"{n}a", f"{n}b"):
        code, out = _side_job(soak, job, name, script)
        if code != 0 or f"reuse-run {name} round 0" not in out:
            tail = " | ".join(line.strip()[:160] for line in out.strip().splitlines()[-3:])
            soak.violations.append(f"job_reuse: run {name} of {job} exited {code} (expected 0, from round 0): {tail}")
            return
    f.recovered_at = time.time()
    f.notes.append("the second run started from round 0 with its own arguments")

__all__ = ["BAD_RECORDS", "bad_record", "job_reuse", "slow_metrics"]
