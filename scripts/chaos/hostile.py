"""The chaos soak's fault kinds from outside the job: a malformed record in its etcd prefix, a burst of stalled
clients on an agent's metrics port, and its id reused by a job with other arguments right after that job ends.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.records import topology_record
from elasticrun.store.client import connect
from elasticrun.store.types import Guard

from .faults import Fault, FaultKind, Recovery

if TYPE_CHECKING:
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


class BadRecord(FaultKind):
    """One record of the running job is overwritten for 3-6 s with something the agents do not expect. The job
    must train on; every agent that read it says so once (which key, what was wrong), never twice, and none
    exits; ``elasticrun status --json`` still answers. The record is removed at the end (unless rewritten)."""

    name, recovery, span = "bad_record", Recovery.ANY_STEP, (3.0, 6.0)  # every agent's loop turns meanwhile

    def inject(self, soak: Soak, f: Fault) -> None:
        keys = JobKeys(soak.launcher.job)
        what, key_of, value = f.choose(BAD_RECORDS)
        with connect(soak.launcher.endpoint, retry_timeout=30) as store:
            topology = records.read(store.get(keys.topology), topology_record)  # the current round, its nodes
            node = topology.members[0].node_id if topology and topology.members else "slot0.0"
            key = key_of(keys, topology.round if topology else 0, node)
            f.target = f"{what} at {key[len(keys.prefix):]}"
            rev = store.put(key, value)
            soak.sleep(f.duration / 2)
            self._status_answers(soak, f)
            soak.sleep(f.duration / 2)
            if store.txn([Guard(key, rev)], deletes=[key]):
                f.notes.append("removed again")
        f.noted["key"] = key

    def check(self, soak: Soak, f: Fault) -> None:
        reports = soak.log_counts(NOTICE + str(f.noted["key"]) + ":")
        twice = {agent: n for agent, n in reports.items() if n > 1}
        if twice:
            soak.violations.append(f"bad_record {f.noted['key']}: reported more than once by {twice} (once is "
                                   "the rule)")
        f.notes.append(f"reported by {len(reports)} agent(s)" if reports else "no agent read it during the fault")

    @staticmethod
    def _status_answers(soak: Soak, f: Fault) -> None:
        """``elasticrun status --json`` of the job (it reads every record) answers with one document."""
        doc, error = soak.launcher.status_json()
        if doc is None:
            soak.violations.append(f"bad_record ({f.target}): {error}")


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


class SlowMetrics(FaultKind):
    """~100 connections to one agent's ``--metrics-port`` each send half an HTTP request and stall for 4-10 s.
    The job must train on; whether a well-behaved scrape still answered meanwhile is noted."""

    name, recovery, span = "slow_metrics", Recovery.ANY_STEP, (4.0, 10.0)

    def inject(self, soak: Soak, f: Fault) -> None:
        agents = [a for a in soak.launcher.live() if a.slot != soak.launcher.ns_slot]
        if not agents:
            f.skipped = "no agent serves /metrics here"
            return
        agent = f.choose(agents)
        socks = [s for s in (_half_request(agent.metrics_port) for _ in range(SLOW_CLIENTS)) if s is not None]
        f.target = f"{len(socks)} stalled clients on agent {agent.label}'s /metrics for {f.duration:.0f}s"
        try:
            soak.sleep(f.duration / 2)
            took = _scrape(agent.metrics_port)
            f.notes.append(f"a scrape meanwhile answered in {took:.2f}s" if took is not None
                           else f"a scrape meanwhile got no answer within {SCRAPE_WAIT_S:.0f}s")
            soak.sleep(f.duration / 2)
        finally:
            for s in socks:
                s.close()


class JobReuse(FaultKind):
    """A short one-node side job under its own id runs to its end; the moment its agent exits, a job with other
    arguments starts under the same id (a scheduler resubmitting an edited job). It must start from its first
    round, run its script with its own arguments and exit 0."""

    name, recovery = "job_reuse", Recovery.REUSED

    def inject(self, soak: Soak, f: Fault) -> None:
        n = sum(1 for x in soak.faults if x.kind.name == self.name)
        job = f"{soak.launcher.job}-reuse"
        script = soak.machine.run_dir / "reuse_script.py"
        script.write_text("import os, sys\nprint('reuse-run', sys.argv[1], 'round', os.environ['ELASTICRUN_ROUND'])\n")
        f.target = f"job {job}: run {n}a ends, run {n}b starts under its id with other arguments"
        for name in (f"{n}a", f"{n}b"):
            code, out = self._side_job(soak, job, name, script)
            if code != 0 or f"reuse-run {name} round 0" not in out:
                tail = " | ".join(line.strip()[:160] for line in out.strip().splitlines()[-3:])
                soak.violations.append(f"job_reuse: run {name} of {job} exited {code} (expected 0, from round 0): "
                                       f"{tail}")
                return
        f.recovered_at = time.time()
        f.notes.append("the second run started from round 0 with its own arguments")

    @staticmethod
    def _side_job(soak: Soak, job: str, name: str, script: Path) -> Tuple[int, str]:
        """Run a one-node job of ``script`` to its end; (exit code, its output)."""
        launcher = soak.launcher
        log = soak.machine.run_dir / f"reuse-{name}.log"
        cmd = [sys.executable, "-m", "elasticrun", "run", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint",
               launcher.endpoint, "--rdzv-id", job, "--node-id", f"reuse-{name}", "--standby", "0", "--no-prewarm",
               "--no-snapshots", "--ended-job-ttl", "10m", "--heartbeat-timeout", f"{launcher.heartbeat:g}",
               str(script), name]
        with open(log, "wb") as out:
            try:
                code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=launcher.env, cwd=str(launcher.code_root), timeout=REUSE_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                code = -1
        return code, log.read_text(errors="replace")
