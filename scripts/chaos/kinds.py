"""The chaos soak's fault kinds on the job's processes, etcd and the machine, and ``KINDS``, every kind by name
(those from outside the job are in ``hostile.py``). docs/reliability.md's table says what each does, and why
rank 0's node is spared by the kinds whose loss would otherwise be recovered in place."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from elasticrun.job.exitcodes import ExitCode
from scripts.bench.common import kill_tree

from .audit import Gen
from .env import AgentProc, NetNs, Tmpfs, etcd_leader, last_lines, send, write_atomic
from .faults import Fault, FaultKind, Recovery
from .hostile import BadRecord, JobReuse, SlowMetrics

if TYPE_CHECKING:
    from .env import Machine
    from .soak import Soak

NODE_SLOTS = 4
# what an agent's log shows when --hang-timeout stops a round: the failure line, the workers' stack dumps
HANG_MARKS = ("no progress for", "(most recent call first)")


def _spare_rank0(soak: Soak, items: List[Any], node: Callable[[Any], str]) -> List[Any]:
    """``items`` but those on rank 0's node, when there are others: the state of an in-place re-form is sent from
    rank 0, so its loss takes the restart path (which other faults cover)."""
    return [x for x in items if node(x) != soak.rank0_node()] or items


def _worker(soak: Soak, f: Fault, on_rank0: bool = False) -> Optional[Tuple[int, str]]:
    """(pid, node) of the live worker ``f`` picks -- rank 0's or, when there are others, not -- or None
    (``f.skipped`` says so)."""
    procs = soak.current_workers()
    procs = [w for w in procs if w[1] == soak.rank0_node()] if on_rank0 else _spare_rank0(soak, procs, lambda w: w[1])
    if not procs:
        f.skipped = "no live worker"
        return None
    return f.choose(procs)


def _rejoin(soak: Soak, f: Fault, agent: AgentProc, gen0: Optional[Gen]) -> None:
    """Once the others trained in a round without ``agent`` (they re-formed), start a new agent for its slot."""
    soak.wait(lambda: gen0 is None or soak.step_gen > gen0, soak.deadline_s)
    soak.sleep(f.duration)
    f.notes.append(f"new agent {soak.launcher.start(agent.slot).label} after {time.time() - f.t_start:.1f}s")


class WorkerKill(FaultKind):
    """SIGKILL one worker of the current round."""

    name = "worker_kill"

    def inject(self, soak: Soak, f: Fault) -> None:
        got = _worker(soak, f)
        if got:
            f.target = f"worker pid {got[0]} of {got[1]}"
            send(got[0], signal.SIGKILL)


class AgentKill(FaultKind):
    """SIGKILL one node (its agent and every process below it); a new agent rejoins for it. With a hosted etcd,
    a node that runs one of its members (the first host while it lives)."""

    name, span = "agent_kill", (0.5, 4.0)

    def inject(self, soak: Soak, f: Fault) -> None:
        launcher = soak.launcher
        if launcher.hosted and not soak.wait(launcher.members_settled, soak.deadline_s):
            soak.violations.append(f"the job's etcd did not have the members its {len(launcher.live())} nodes "
                                   f"call for within {soak.deadline_s:.0f}s (endpoints {launcher.endpoint})")
        live = soak.live_agents()
        holders = [a for a in launcher.member_agents() if a in live] if launcher.hosted else []
        agent, gen0 = holders[0] if holders else f.choose(_spare_rank0(soak, live, lambda a: a.label)), soak.newest_gen
        f.target, agent.expected_exit = f"node {agent.label}{' (runs a member of the etcd)' * bool(holders)}", True
        kill_tree([agent.pid])
        if holders and not soak.wait(launcher.members_settled, soak.deadline_s):
            f.notes.append("the job's etcd did not settle on its members")
        _rejoin(soak, f, agent, gen0)


class AgentStop(FaultKind):
    """SIGSTOP one agent for longer than its lease, then SIGCONT."""

    name, span, beyond_heartbeat = "agent_stop", (2.0, 6.0), True

    def inject(self, soak: Soak, f: Fault) -> None:
        agent = f.choose(soak.live_agents())
        f.target, agent.stopped = f"agent {agent.label} for {f.duration:.1f}s", True
        send(agent.pid, signal.SIGSTOP)
        soak.sleep(f.duration)
        send(agent.pid, signal.SIGCONT)
        agent.stopped = False


class GracefulLeave(FaultKind):
    """SIGTERM one agent, which must exit 143 (drained); a new agent rejoins for it."""

    name = "graceful_leave"
    rejoin = True

    def inject(self, soak: Soak, f: Fault) -> None:
        # node_leave spares the partitioned slot: the partition fault cuts that slot off, so it must run
        agents = [a for a in soak.live_agents() if self.rejoin or a.slot != soak.launcher.ns_slot]
        agent, gen0 = f.choose(_spare_rank0(soak, agents, lambda a: a.label)), soak.newest_gen
        f.target, agent.expected_exit, f.noted["agent"] = f"agent {agent.label} (SIGTERM)", True, agent
        send(agent.pid, signal.SIGTERM)
        if self.rejoin:
            _rejoin(soak, f, agent, gen0)

    def check(self, soak: Soak, f: Fault) -> None:
        agent = f.noted["agent"]
        soak.wait(lambda: agent.proc.poll() is not None, soak.deadline_s)
        if agent.proc.returncode != ExitCode.DRAINED:
            soak.violations.append(f"{f.kind.name}: agent {agent.label} ended with {agent.proc.returncode} after "
                                   f"SIGTERM, not {ExitCode.DRAINED.value}: {last_lines(agent.log_path, 3)}")


class NodeLeave(GracefulLeave):
    """A graceful leave without a new agent (node_join's counterpart when every slot runs)."""

    name, drawn, rejoin = "node_leave", False, False


class NodeJoin(FaultKind):
    """A new node joins; when all 4 slots run, one leaves instead (``node_leave``)."""

    name = "node_join"

    def inject(self, soak: Soak, f: Fault) -> None:
        used = {a.slot for a in soak.launcher.live()}
        free = [s for s in range(NODE_SLOTS) if s not in used]
        if not free:
            f.kind = KINDS["node_leave"]
            f.kind.inject(soak, f)
            return
        f.target = f"new agent {soak.launcher.start(f.choose(free)).label}"


class EtcdRestart(FaultKind):
    """SIGTERM the etcd member and start it again on the same data."""

    name, recovery, etcd_members = "etcd_restart", Recovery.ANY_STEP, 1

    def inject(self, soak: Soak, f: Fault) -> None:
        etcd = soak.machine.etcd
        assert etcd is not None and etcd.proc is not None
        f.target = f"etcd pid {etcd.proc.pid}"
        etcd.stop(remove_data=False)
        etcd.start(timeout=60)


class EtcdOutage(FaultKind):
    """SIGSTOP the etcd member for 2 s up to min(60, 2 * minutes) s, then SIGCONT."""

    name, recovery, etcd_members = "etcd_outage", Recovery.ANY_STEP, 1

    def duration(self, rng: random.Random, minutes: float, heartbeat: float) -> float:
        return rng.uniform(2.0, max(2.0, min(60.0, 2.0 * minutes)))

    def inject(self, soak: Soak, f: Fault) -> None:
        etcd = soak.machine.etcd
        assert etcd is not None and etcd.proc is not None
        f.target = f"etcd SIGSTOP for {f.duration:.1f}s"
        send(etcd.proc.pid, signal.SIGSTOP)
        try:
            soak.sleep(f.duration)
        finally:
            send(etcd.proc.pid, signal.SIGCONT)


class MemberLoss(FaultKind):
    """(3-member etcd) SIGKILL a follower member, restart it on its data 2-6 s later."""

    name, recovery, etcd_members, span = "member_loss", Recovery.ANY_STEP, 3, (2.0, 6.0)
    leader = False

    def inject(self, soak: Soak, f: Fault) -> None:
        cluster = soak.machine.members
        assert cluster is not None
        lead = etcd_leader(cluster)
        if self.leader:
            victims = [lead] if lead is not None else []
        else:
            victims = [m for m in cluster.members.values() if m.running() and m is not lead]
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
    """(3-member etcd) SIGKILL the leader member, restart it on its data 2-6 s later."""

    name, leader = "leader_loss", True


class DiskFull(FaultKind):
    """Fill the checkpoint tmpfs until a save fails (at most 15 s), then free it."""

    name, recovery, span = "disk_full", Recovery.CHECKPOINT, (15.0, 15.0)  # at most, or until a save failed

    def prepare(self, machine: Machine) -> Optional[str]:
        return machine.set_up("tmpfs", Tmpfs(machine.ckpt_root, 64), "mount -t tmpfs")

    def inject(self, soak: Soak, f: Fault) -> None:
        tmpfs = soak.machine.tmpfs
        assert tmpfs is not None
        fails0 = soak.count("save_failed")
        f.target = f"checkpoint tmpfs filled ({tmpfs.fill() >> 20} MiB ballast)"
        bit = soak.wait(lambda: soak.count("save_failed") > fails0, f.duration)
        f.notes.append("a save failed with the disk full" if bit else "no save was attempted while full")
        tmpfs.drain()


class Partition(FaultKind):
    """Cut the network of the node in its own namespace for longer than its lease, then heal it."""

    # one etcd member: the 3-member and the hosted etcd listen on loopback only
    name, span, beyond_heartbeat, etcd_members = "partition", (2.0, 6.0), True, 1

    def prepare(self, machine: Machine) -> Optional[str]:
        return machine.set_up("netns", NetNs(str(os.getpid() % 100000)), "network namespaces")

    def inject(self, soak: Soak, f: Fault) -> None:
        netns = soak.machine.netns
        assert netns is not None
        f.target = f"node slot{soak.launcher.ns_slot} cut off for {f.duration:.1f}s"
        netns.partition(True)
        try:
            soak.sleep(f.duration)
        finally:
            netns.partition(False)


class ShmFull(FaultKind):
    """Rank 0's node's memory tier full (cap 1 byte) while its worker restarts and snapshots."""

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


class Hang(FaultKind):
    """One worker stops making progress without dying; the agents' --hang-timeout must restart the round."""

    name = "hang"

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

    @staticmethod
    def _reports(soak: Soak) -> int:
        return sum(n for mark in HANG_MARKS for n in soak.log_counts(mark).values())


#: Every kind by name, in the order a seeded schedule shuffles them.
KINDS: Dict[str, FaultKind] = {k.name: k for k in (
    WorkerKill(), AgentKill(), AgentStop(), GracefulLeave(), NodeJoin(), NodeLeave(), EtcdRestart(), EtcdOutage(),
    DiskFull(), Partition(), ShmFull(), MemberLoss(), LeaderLoss(), Hang(), BadRecord(), SlowMetrics(), JobReuse())}
DRAWN: List[FaultKind] = [k for k in KINDS.values() if k.drawn]
