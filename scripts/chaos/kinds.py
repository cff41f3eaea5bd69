"""The chaos soak's faults: ``FaultKind`` (one class per kind, registered in ``KINDS``), ``Fault`` (one
occurrence) and ``schedule`` (the seeded or given order). docs/reliability.md's table says what each kind does."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple

from elasticrun.job import records
from elasticrun.job.exitcodes import ExitCode
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.records import topology_record
from elasticrun.store.client import connect
from elasticrun.store.types import Guard
from scripts.bench.common import kill_tree, send

from .env import NetNs, Tmpfs, etcd_leader, last_lines, write_atomic

if TYPE_CHECKING:
    from .env import AgentProc, Machine
    from .soak import Soak


class Recovery(str, Enum):
    """Recovered at: a step of a round formed after the fault; any step; a checkpoint; the reused id's job's end."""

    NEW_ROUND, ANY_STEP, CHECKPOINT, REUSED = "new_round", "any_step", "checkpoint", "reused"


class How(str, Enum):
    """Rounds formed until the next fault: each kept the others' workers; one restarted every worker; none."""

    IN_PLACE, RESTART, NONE = "in_place", "restart", "none"


class FaultKind:
    """One kind of fault: its recovery, its duration, ``prepare`` (the machine), ``inject`` and ``check``."""

    name: ClassVar[str]
    recovery: ClassVar[Recovery] = Recovery.NEW_ROUND
    etcd_members: ClassVar[int] = 0  # 1 or 3: only with that many etcd members; 0: with any
    drawn: ClassVar[bool] = True  # False: never scheduled itself (node_leave is node_join's counterpart)
    span: ClassVar[Tuple[float, float]] = (0.0, 0.0)  # seconds it lasts, drawn uniformly
    beyond_heartbeat: ClassVar[bool] = False  # the span comes on top of the agents' heartbeat timeout

    def duration(self, rng: random.Random, minutes: float, heartbeat: float) -> float:
        lo, hi = self.span
        return (heartbeat if self.beyond_heartbeat else 0.0) + (rng.uniform(lo, hi) if hi > lo else lo)

    def prepare(self, machine: Machine) -> Optional[str]:
        """Set the machine up before the job starts; why this kind cannot run here, or None."""
        return None

    def inject(self, soak: Soak, fault: Fault) -> None:
        """Do the fault and heal it; set ``fault.target``, or ``fault.skipped`` (why nothing was done)."""
        raise NotImplementedError

    def check(self, soak: Soak, fault: Fault) -> None:
        """After the recovery wait: this kind's own invariants (appended to ``soak.violations``)."""


@dataclass
class Fault:
    """One fault as drawn, then as it happened."""

    kind: FaultKind
    pick: float  # which target: a position in [0, 1) over the eligible targets at injection time
    duration: float
    gap: float  # seconds of normal training after recovery before the next fault
    t_start: float = 0.0
    t_end: float = 0.0  # when the fault was healed
    target: str = ""
    recovered_at: Optional[float] = None
    full_at: Optional[float] = None  # when every live node trained again in one generation
    notes: List[str] = field(default_factory=list)
    skipped: Optional[str] = None
    noted: Dict[str, Any] = field(default_factory=dict)  # what ``inject`` noted for ``check``
    how: How = How.NONE

    def choose(self, items: Sequence[Any]) -> Any:
        return items[int(self.pick * len(items)) % len(items)]

    @property
    def t_ref(self) -> float:
        """Timed from the start when the job must re-form or a reused id's job run, else from the end (healed)."""
        return self.t_start if self.kind.recovery in (Recovery.NEW_ROUND, Recovery.REUSED) else self.t_end

    @property
    def ttr(self) -> Optional[float]:
        return None if self.recovered_at is None else max(0.0, self.recovered_at - self.t_ref)

    def to_json(self) -> Dict[str, Any]:
        return {"kind": self.kind.name, "target": self.target, "start": round(self.t_start, 3),
                "healed": round(self.t_end, 3), "timed_from": "start" if self.t_ref == self.t_start else "end",
                "duration_s": round(self.duration, 2), "recovery": self.kind.recovery,
                "recovered": self.recovered_at is not None, "recovered_how": self.how,
                "time_to_recover_s": None if self.ttr is None else round(self.ttr, 2),
                "time_to_full_strength_s": None if self.full_at is None else round(self.full_at - self.t_ref, 2),
                "notes": self.notes, "skipped": self.skipped}


def schedule(seed: int, kinds: Sequence[FaultKind], minutes: float, heartbeat: float,
             shuffle: bool = True) -> Iterator[Fault]:
    """Endless rounds of ``kinds`` (each shuffled, or in the order given), drawn from ``random.Random(seed)``;
    gaps of 1-2 s in runs of up to 3 minutes, 1-8 s in longer ones."""
    rng = random.Random(seed)
    gap_hi = 2.0 if minutes <= 3 else 8.0
    while True:
        order = list(kinds)
        if shuffle:
            rng.shuffle(order)
        for kind in order:
            duration = kind.duration(rng, minutes, heartbeat)
            yield Fault(kind, rng.random(), duration, rng.uniform(1.0, gap_hi))


def _spare_rank0(soak: Soak, items: List[Any], node: Callable[[Any], str]) -> List[Any]:
    """``items`` but those on rank 0's node, when there are others: losing the node an in-place re-form's state
    is sent from takes the restart path (which other faults cover)."""
    return [x for x in items if node(x) != soak.rank0_node()] or items


def _worker(soak: Soak, f: Fault, on_rank0: bool = False) -> Optional[Tuple[int, str]]:
    """(pid, node) of a live worker -- rank 0's, or when there are others not -- or None (``f.skipped`` set)."""
    procs = soak.current_workers()
    procs = [w for w in procs if w[1] == soak.rank0_node()] if on_rank0 else _spare_rank0(soak, procs, lambda w: w[1])
    if not procs:
        f.skipped = "no live worker"
        return None
    return f.choose(procs)


def _rejoin(soak: Soak, f: Fault, agent: AgentProc, gen0: Optional[Tuple[int, int]]) -> None:
    """Once the others trained in a round without ``agent``, start a new agent for its slot."""
    soak.wait(lambda: gen0 is None or soak.step_gen > gen0, soak.deadline_s)
    soak.sleep(f.duration)
    f.notes.append(f"new agent {soak.machine.start(agent.slot).label} after {time.time() - f.t_start:.1f}s")


class WorkerKill(FaultKind):
    name = "worker_kill"

    def inject(self, soak: Soak, f: Fault) -> None:
        got = _worker(soak, f)
        if got:
            f.target = f"worker pid {got[0]} of {got[1]}"
            send(got[0], signal.SIGKILL)


class AgentKill(FaultKind):
    name, span = "agent_kill", (0.5, 4.0)

    def inject(self, soak: Soak, f: Fault) -> None:
        machine = soak.machine  # with a hosted etcd: kill a node that runs a member, the first host while it lives
        if machine.hosted and not soak.wait(machine.members_settled, soak.deadline_s):
            soak.violations.append(f"the job's etcd did not have the members its {len(machine.live())} nodes "
                                   f"call for within {soak.deadline_s:.0f}s (endpoints {machine.endpoint})")
        live = soak.live_agents()
        holders = [a for a in machine.member_agents() if a in live] if machine.hosted else []
        agent, gen0 = holders[0] if holders else f.choose(_spare_rank0(soak, live, lambda a: a.label)), soak.newest_gen
        f.target, agent.expected_exit = f"node {agent.label}{' (runs a member of the etcd)' * bool(holders)}", True
        kill_tree([agent.proc.pid])
        if holders and not soak.wait(machine.members_settled, soak.deadline_s):
            f.notes.append("the job's etcd did not settle on its members")
        _rejoin(soak, f, agent, gen0)


class AgentStop(FaultKind):
    name, span, beyond_heartbeat = "agent_stop", (2.0, 6.0), True

    def inject(self, soak: Soak, f: Fault) -> None:
        agent = f.choose(soak.live_agents())
        f.target, agent.stopped = f"agent {agent.label} for {f.duration:.1f}s", True
        send(agent.proc.pid, signal.SIGSTOP)
        soak.sleep(f.duration)
        send(agent.proc.pid, signal.SIGCONT)
        agent.stopped = False


class GracefulLeave(FaultKind):
    name, rejoin = "graceful_leave", True

    def inject(self, soak: Soak, f: Fault) -> None:
        # node_leave spares the partitioned slot: the partition fault cuts that slot off, so it must run
        agents = [a for a in soak.live_agents() if self.rejoin or a.slot != soak.machine.ns_slot]
        agent, gen0 = f.choose(_spare_rank0(soak, agents, lambda a: a.label)), soak.newest_gen
        f.target, agent.expected_exit, f.noted["agent"] = f"agent {agent.label} (SIGTERM)", True, agent
        send(agent.proc.pid, signal.SIGTERM)
        if self.rejoin:
            _rejoin(soak, f, agent, gen0)

    def check(self, soak: Soak, f: Fault) -> None:
        agent = f.noted["agent"]
        soak.wait(lambda: agent.proc.poll() is not None, soak.deadline_s)
        if agent.proc.returncode != ExitCode.DRAINED:
            soak.violations.append(f"{f.kind.name}: agent {agent.label} ended with {agent.proc.returncode} after "
                                   f"SIGTERM, not {ExitCode.DRAINED.value}: {last_lines(agent.log_path, 3)}")


class NodeJoin(FaultKind):
    name = "node_join"

    def inject(self, soak: Soak, f: Fault) -> None:
        free = sorted(set(range(4)) - {a.slot for a in soak.machine.live()})
        if not free:  # every slot runs: one leaves instead
            f.kind = KINDS["node_leave"]
            f.kind.inject(soak, f)
            return
        f.target = f"new agent {soak.machine.start(f.choose(free)).label}"


class NodeLeave(GracefulLeave):
    name, drawn, rejoin = "node_leave", False, False


class EtcdRestart(FaultKind):
    name, recovery, etcd_members = "etcd_restart", Recovery.ANY_STEP, 1

    def inject(self, soak: Soak, f: Fault) -> None:
        etcd = soak.machine.etcd
        f.target = f"etcd pid {etcd.proc.pid}"
        etcd.stop(remove_data=False)
        etcd.start(timeout=60)


class EtcdOutage(FaultKind):
    name, recovery, etcd_members = "etcd_outage", Recovery.ANY_STEP, 1

    def duration(self, rng: random.Random, minutes: float, heartbeat: float) -> float:
        return rng.uniform(2.0, max(2.0, min(60.0, 2.0 * minutes)))

    def inject(self, soak: Soak, f: Fault) -> None:
        pid = soak.machine.etcd.proc.pid
        f.target = f"etcd SIGSTOP for {f.duration:.1f}s"
        send(pid, signal.SIGSTOP)
        try:
            soak.sleep(f.duration)
        finally:
            send(pid, signal.SIGCONT)


class DiskFull(FaultKind):
    name, recovery, span = "disk_full", Recovery.CHECKPOINT, (15.0, 15.0)  # at most, or until a save failed

    def prepare(self, machine: Machine) -> Optional[str]:
        return machine.set_up("tmpfs", Tmpfs(machine.ckpt_root, 64), "mount -t tmpfs")

    def inject(self, soak: Soak, f: Fault) -> None:
        tmpfs, fails0 = soak.machine.tmpfs, soak.count("save_failed")
        f.target = f"checkpoint tmpfs filled ({tmpfs.fill() >> 20} MiB ballast)"
        bit = soak.wait(lambda: soak.count("save_failed") > fails0, f.duration)
        f.notes.append("a save failed with the disk full" if bit else "no save was attempted while full")
        tmpfs.drain()


class Partition(FaultKind):
    # one etcd member: the 3-member and the hosted etcd listen on loopback only
    name, span, beyond_heartbeat, etcd_members = "partition", (2.0, 6.0), True, 1

    def prepare(self, machine: Machine) -> Optional[str]:
        return machine.set_up("netns", NetNs(str(os.getpid() % 100000)), "network namespaces")

    def inject(self, soak: Soak, f: Fault) -> None:
        netns = soak.machine.netns
        f.target = f"node slot{soak.machine.ns_slot} cut off for {f.duration:.1f}s"
        netns.partition(True)
        try:
            soak.sleep(f.duration)
        finally:
            netns.partition(False)


class ShmFull(FaultKind):
    name, span = "shm_full", (15.0, 15.0)  # at most, or until a snapshot was refused

    def prepare(self, machine: Machine) -> Optional[str]:
        machine.worker_args += ["--snapshot-every", "5"]  # the memory tier in use
        return None

    def inject(self, soak: Soak, f: Fault) -> None:
        got = _worker(soak, f, on_rank0=True)  # the restart path: every worker restores, some in the full tier
        if not got:
            return
        pid, node = got
        f.target = f"memory tier of {node} full (cap 1 byte); its worker pid {pid} SIGKILLed to restore"
        refused0, fell0 = soak.count("snapshot_failed"), soak.count("restore_fallback")
        write_atomic(soak.machine.shm_file, node)
        send(pid, signal.SIGKILL)
        bit = soak.wait(lambda: soak.count("snapshot_failed") > refused0, f.duration)
        f.notes.append("a snapshot was refused" if bit else "no snapshot was attempted while full")
        fell = soak.count("restore_fallback") - fell0
        if fell:
            f.notes.append(f"{fell} memory restore(s) refused: fell back")
        soak.machine.shm_file.unlink(missing_ok=True)


class MemberLoss(FaultKind):
    name, recovery, etcd_members, span = "member_loss", Recovery.ANY_STEP, 3, (2.0, 6.0)
    leader = False

    def inject(self, soak: Soak, f: Fault) -> None:
        cluster = soak.machine.members
        lead = etcd_leader(cluster)
        victims = [m for m in cluster.members.values() if m.running() and (m is lead) == self.leader]
        if not victims:
            f.skipped = "no etcd leader found" if self.leader else "no follower running"
            return
        m = f.choose(victims)
        f.target = f"etcd member {m.name} ({'leader' if m is lead else 'follower'}) down {f.duration:.1f}s"
        steps0 = soak.count("step")
        m.kill()
        soak.sleep(f.duration)
        f.notes.append(f"{soak.count('step') - steps0} rank-steps trained while it was down")
        m.restart(timeout=60)


class LeaderLoss(MemberLoss):
    name, leader = "leader_loss", True


class Hang(FaultKind):
    name = "hang"
    marks = ("no progress for", "(most recent call first)")  # an agent's log when --hang-timeout fired

    def prepare(self, machine: Machine) -> Optional[str]:
        return None if machine.hang_timeout else "--hang-timeout 0 (hang detection off)"

    def inject(self, soak: Soak, f: Fault) -> None:
        got = _worker(soak, f)
        if got:
            f.target = f"worker pid {got[0]} of {got[1]} sleeps at its next step"
            f.noted["reports"] = self._reports(soak)
            write_atomic(soak.machine.hang_file, str(got[0]))

    def check(self, soak: Soak, f: Fault) -> None:
        soak.machine.hang_file.unlink(missing_ok=True)
        if f.recovered_at is not None and self._reports(soak) <= f.noted["reports"]:
            soak.violations.append(f"hang ({f.target}) at +{f.t_start - soak.t0:.0f}s: the round restarted but "
                                   "no agent reported it hung (--hang-timeout did not fire)")

    def _reports(self, soak: Soak) -> int:
        return sum(n for mark in self.marks for n in soak.log_counts(mark).values())


# A record the agents read while a round runs (its key from the job's keys, round and a node) and a bad value.
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
    """Every agent that read the record reports it exactly once and none exits; ``status --json`` answers."""

    name, recovery, span = "bad_record", Recovery.ANY_STEP, (3.0, 6.0)  # every agent's loop turns meanwhile
    notice = "ignoring a malformed record in etcd at "

    def inject(self, soak: Soak, f: Fault) -> None:
        keys = JobKeys(soak.machine.job)
        what, key_of, value = f.choose(BAD_RECORDS)
        with connect(soak.machine.endpoint, retry_timeout=30) as store:
            topology = records.read(store.get(keys.topology), topology_record)  # the current round, its nodes
            node = topology.members[0].node_id if topology and topology.members else "slot0.0"
            key = f.noted["key"] = key_of(keys, topology.round if topology else 0, node)
            f.target = f"{what} at {key[len(keys.prefix):]}"
            rev = store.put(key, value)
            soak.sleep(f.duration / 2)
            doc, error = soak.machine.status_json()
            if doc is None:
                soak.violations.append(f"bad_record ({f.target}): {error}")
            soak.sleep(f.duration / 2)
            if store.txn([Guard(key, rev)], deletes=[key]):
                f.notes.append("removed again")

    def check(self, soak: Soak, f: Fault) -> None:
        reports = soak.log_counts(self.notice + str(f.noted["key"]) + ":")
        twice = {agent: n for agent, n in reports.items() if n > 1}
        if twice:
            soak.violations.append(f"bad_record {f.noted['key']}: reported more than once by {twice}")
        f.notes.append(f"reported by {len(reports)} agent(s)" if reports else "no agent read it during the fault")


def _stalled_client(port: int) -> Optional[socket.socket]:
    with contextlib.suppress(OSError):
        s = socket.create_connection(("127.0.0.1", port), timeout=2.0)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: chaos\r\n")  # no blank line: the request never ends
        return s
    return None


class SlowMetrics(FaultKind):
    """~100 clients of one agent's ``--metrics-port`` stall in half a request; a well-behaved scrape is timed."""

    name, recovery, span = "slow_metrics", Recovery.ANY_STEP, (4.0, 10.0)

    def inject(self, soak: Soak, f: Fault) -> None:
        agents = [a for a in soak.machine.live() if a.slot != soak.machine.ns_slot]
        if not agents:
            f.skipped = "no agent serves /metrics here"
            return
        agent = f.choose(agents)
        socks = [s for s in (_stalled_client(agent.metrics_port) for _ in range(100)) if s is not None]
        f.target = f"{len(socks)} stalled clients on agent {agent.label}'s /metrics for {f.duration:.0f}s"
        try:
            soak.sleep(f.duration / 2)
            f.notes.append(self._scrape(agent.metrics_port))
            soak.sleep(f.duration / 2)
        finally:
            for s in socks:
                s.close()

    @staticmethod
    def _scrape(port: int, wait: float = 5.0) -> str:
        started = time.monotonic()
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: chaos\r\nConnection: close\r\n\r\n")
            if s.recv(64).startswith(b"HTTP/"):
                return f"a scrape meanwhile answered in {time.monotonic() - started:.2f}s"
        return f"a scrape meanwhile got no answer within {wait:.0f}s"


class JobReuse(FaultKind):
    """A one-node side job runs to its end; the moment it exits, a job with other arguments starts under the same
    id. It must start from round 0, run with its own arguments and exit 0."""

    name, recovery = "job_reuse", Recovery.REUSED

    def inject(self, soak: Soak, f: Fault) -> None:
        n, machine = sum(1 for x in soak.faults if x.kind.name == self.name), soak.machine
        job, script = f"{machine.job}-reuse", machine.run_dir / "reuse_script.py"
        script.write_text("import os, sys\nprint('reuse-run', sys.argv[1], 'round', os.environ['ELASTICRUN_ROUND'])\n")
        f.target = f"job {job}: run {n}a ends, run {n}b starts under its id with other arguments"
        for name in (f"{n}a", f"{n}b"):
            log = machine.run_dir / f"reuse-{name}.log"
            cmd = [sys.executable, "-m", "elasticrun", "run", "--nnodes", "1", "--nproc-per-node", "1",
                   "--rdzv-endpoint", machine.endpoint, "--rdzv-id", job, "--node-id", f"reuse-{name}",
                   "--standby", "0", "--no-prewarm", "--no-snapshots", "--ended-job-ttl", "10m",
                   "--heartbeat-timeout", f"{machine.heartbeat:g}", str(script), name]
            with open(log, "wb") as out:
                try:
                    code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=machine.env, cwd=str(machine.code_root), timeout=120).returncode
                except subprocess.TimeoutExpired:
                    code = -1
            if code != 0 or f"reuse-run {name} round 0" not in log.read_text(errors="replace"):
                soak.violations.append(f"job_reuse: run {name} of {job} exited {code} (expected 0, from round 0): "
                                       f"{last_lines(log, 3)}")
                return
        f.recovered_at = time.time()
        f.notes.append("the second run started from round 0 with its own arguments")


#: Every kind by name, in the order a seeded schedule shuffles them.
KINDS: Dict[str, FaultKind] = {k.name: k for k in (
    WorkerKill(), AgentKill(), AgentStop(), GracefulLeave(), NodeJoin(), NodeLeave(), EtcdRestart(), EtcdOutage(),
    DiskFull(), Partition(), ShmFull(), MemberLoss(), LeaderLoss(), Hang(), BadRecord(), SlowMetrics(), JobReuse())}
DRAWN: List[FaultKind] = [k for k in KINDS.values() if k.drawn]
