"""The chaos soak's run loop: start the job, inject each scheduled fault, wait for its recovery."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from elasticrun.store.server import EtcdServer

from .audit import Gen, gen_of
from .env import AgentProc, Launcher, NetNs, Tmpfs, kill_tree
from .faults import Fault, Kind, Recovery
from .hostile import bad_record, job_reuse, slow_metrics
from .members import Members
from .tail import Tail

NODE_SLOTS = 4
# what an agent's log shows when --hang-timeout stops a round: the failure line, the workers' stack dumps
HANG_MARKS = ("no progress for", "(most recent call first)")
HOSTILE = {Kind.BAD_RECORD: bad_record, Kind.SLOW_METRICS: slow_metrics, Kind.JOB_REUSE: job_reuse}


@dataclass
class Soak:
    """State of one soak run; ``violations`` collects every broken invariant."""

    launcher: Launcher
    etcd: Optional[EtcdServer]  # the one member (None with --etcd-members 3: ``members``)
    tmpfs: Optional[Tmpfs]
    netns: Optional[NetNs]
    ckpt_root: Path
    tail: Tail
    deadline_s: float
    log: Callable[[str], None]
    violations: List[str] = field(default_factory=list)
    faults: List[Fault] = field(default_factory=list)
    newest_gen: Optional[Gen] = None
    last_step_t: float = 0.0
    saves_seen: List[dict] = field(default_factory=list)
    verified: int = 0
    verify_failed: int = 0
    retired: int = 0
    aborted: bool = False
    finishing: bool = False
    keep_going: bool = False
    forced_restarts: int = 0
    hang_file: Optional[Path] = None  # the workers' $CHAOS_HANG_FILE (the hang fault writes a PID there)
    members: Optional[Members] = None  # the 3-member cluster of --etcd-members 3
    shm_file: Optional[Path] = None  # the workers' $CHAOS_SHM_FULL_FILE (the shm_full fault writes a node id)
    _scan_from: int = 0
    gen_started: Dict[Gen, float] = field(default_factory=dict)  # first audit line of each generation
    _t0: float = 0.0

    # -- observation ---------------------------------------------------------------------

    def pump(self) -> List[dict]:
        """Read new audit lines, verify new checkpoints, restart agents that died on their own."""
        new = self.tail.poll()
        for r in new:
            g = gen_of(r)
            self.gen_started.setdefault(g, r["t"])
            if self.newest_gen is None or g > self.newest_gen:
                self.newest_gen = g
            if r["ev"] == "step":
                self.last_step_t = max(self.last_step_t, r["t"])
            if r["ev"] == "save" and int(r["rank"]) == 0:
                self.saves_seen.append(r)
                self._verify(str(r["name"]))
        if self.finishing:
            return new  # agents end now; finish() checks their exit codes
        for a in list(self.launcher.agents):
            rc = a.proc.poll()
            if rc is not None and not a.expected_exit:
                a.expected_exit = True
                tail = _last_lines(a.log_path, 3)
                self.violations.append(f"agent slot{a.slot}.{a.incarnation} exited with code {rc} on its own "
                                       f"at +{time.time() - self.t0:.0f}s: {tail}")
                recent = [b for b in self.launcher.agents if b.slot == a.slot and b.started > time.time() - 60]
                if len(recent) >= 3:
                    self.violations.append(f"slot{a.slot}: 3 agents exited within a minute; giving up")
                    self.aborted = True
                    return new
                self.log(f"!! agent slot{a.slot}.{a.incarnation} exited rc={rc}; starting a new one for the slot")
                self.launcher.start(a.slot)
        return new

    def _verify(self, name: str) -> None:
        from elasticrun.checkpoint import verify
        from elasticrun.errors import ElasticrunError

        if not (self.ckpt_root / name).exists():
            self.retired += 1
            return
        try:
            res = verify(str(self.ckpt_root), name)
        except ElasticrunError as err:
            if not (self.ckpt_root / name).exists():
                self.retired += 1  # removed by retention meanwhile
                return
            res = None
            problem = str(err)
        else:
            problem = "; ".join(res.problems)
        if res is not None and res.ok:
            self.verified += 1
        else:
            self.verify_failed += 1
            self.violations.append(f"checkpoint {name} failed verification: {problem[:300]}")

    @property
    def t0(self) -> float:
        return self._t0

    def start(self, nodes: int) -> None:
        self._t0 = time.time()
        for slot in range(nodes):
            self.launcher.start(slot)

    def wait(self, what: str, cond: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.aborted:
            self.pump()
            if cond():
                return True
            time.sleep(0.2)
        self.pump()
        return cond()

    def sleep(self, seconds: float) -> None:
        self.wait("", lambda: False, seconds)

    # -- faults ----------------------------------------------------------------------------

    def inject(self, f: Fault) -> None:
        """Apply one fault, heal it, wait for its recovery (or record a hang)."""
        f.t_start = time.time()
        self._scan_from = len(self.tail.records)
        gen0 = self.newest_gen
        saves0 = len(self.saves_seen)
        live = [a for a in self.launcher.live() if not a.stopped]
        pick = lambda items: items[int(f.pick * len(items)) % len(items)]  # noqa: E731
        if f.kind in HOSTILE:  # from outside the job: a bad record, slow metrics clients, the id reused
            HOSTILE[f.kind](self, f)
            if f.skipped:
                return
        elif f.kind is Kind.WORKER_KILL:
            procs = self._current_workers()
            if not procs:
                f.skipped = "no live worker"
                return
            pid, node = pick(procs)
            f.target = f"worker pid {pid} of {node}"
            _signal(pid, signal.SIGKILL)
        elif f.kind is Kind.AGENT_KILL:
            agent = pick(live)
            f.target = f"agent slot{agent.slot}.{agent.incarnation}"
            agent.expected_exit = True
            _signal(agent.pid, signal.SIGKILL)
            self.sleep(f.duration)
            new = self.launcher.start(agent.slot)
            f.notes.append(f"new agent slot{new.slot}.{new.incarnation} after {f.duration:.1f}s")
        elif f.kind is Kind.AGENT_STOP:
            agent = pick(live)
            f.target = f"agent slot{agent.slot}.{agent.incarnation} for {f.duration:.1f}s"
            agent.stopped = True
            _signal(agent.pid, signal.SIGSTOP)
            self.sleep(f.duration)
            _signal(agent.pid, signal.SIGCONT)
            agent.stopped = False
        elif f.kind in (Kind.NODE_JOIN, Kind.NODE_LEAVE):
            used = {a.slot for a in self.launcher.live()}
            free = [s for s in range(NODE_SLOTS) if s not in used]
            if free:
                f.kind = Kind.NODE_JOIN
                new = self.launcher.start(pick(free))
                f.target = f"new agent slot{new.slot}.{new.incarnation}"
            else:
                f.kind = Kind.NODE_LEAVE
                leavers = [a for a in live if a.slot != self.launcher.ns_slot]
                agent = pick(leavers)
                f.target = f"agent slot{agent.slot}.{agent.incarnation} (SIGTERM: all 4 slots were running)"
                agent.expected_exit = True
                _signal(agent.pid, signal.SIGTERM)
        elif f.kind in (Kind.MEMBER_LOSS, Kind.LEADER_LOSS):
            assert self.members is not None
            steps0 = self._count("step")
            self.members.lose(f, self.sleep, lambda: f.notes.append(
                f"{self._count('step') - steps0} rank-steps trained while it was down"))
            if f.skipped:
                return
        elif f.kind is Kind.ETCD_RESTART:
            assert self.etcd is not None
            f.target = f"etcd pid {self.etcd.proc.pid if self.etcd.proc else '?'}"
            self.etcd.stop(remove_data=False)
            self.etcd.start(timeout=60)
        elif f.kind is Kind.ETCD_OUTAGE:
            assert self.etcd is not None and self.etcd.proc is not None
            f.target = f"etcd SIGSTOP for {f.duration:.1f}s"
            _signal(self.etcd.proc.pid, signal.SIGSTOP)
            try:
                self.sleep(f.duration)
            finally:
                _signal(self.etcd.proc.pid, signal.SIGCONT)
        elif f.kind is Kind.DISK_FULL:
            assert self.tmpfs is not None
            fails0 = self._save_failures()
            f.target = f"checkpoint tmpfs filled ({self.tmpfs.fill() >> 20} MiB ballast)"
            bit = self.wait("a save to fail", lambda: self._save_failures() > fails0, f.duration)
            f.notes.append("a save failed with the disk full" if bit else "no save was attempted while full")
            self.tmpfs.drain()
        elif f.kind is Kind.PARTITION:
            assert self.netns is not None
            f.target = f"node slot{self.launcher.ns_slot} cut off for {f.duration:.1f}s"
            self.netns.partition(True)
            try:
                self.sleep(f.duration)
            finally:
                self.netns.partition(False)
        elif f.kind is Kind.HANG:
            assert self.hang_file is not None
            procs = self._current_workers()
            if not procs:
                f.skipped = "no live worker"
                return
            pid, node = pick(procs)
            caught0 = self._hang_reports()
            f.target = f"worker pid {pid} of {node} sleeps at its next step"
            _write(self.hang_file, str(pid))
        elif f.kind is Kind.SHM_FULL:
            assert self.shm_file is not None
            procs = self._current_workers()
            if not procs:
                f.skipped = "no live worker"
                return
            pid, node = pick(procs)
            f.target = f"memory tier of {node} full (cap 1 byte); its worker pid {pid} SIGKILLed to restore"
            refused0, fell0 = self._count("snapshot_failed"), self.restore_fallbacks()
            _write(self.shm_file, node)
            _signal(pid, signal.SIGKILL)
            bit = self.wait("a snapshot to be refused", lambda: self._count("snapshot_failed") > refused0,
                            f.duration)
            f.notes.append("a snapshot was refused" if bit else "no snapshot was attempted while full")
            if self.restore_fallbacks() > fell0:
                f.notes.append(f"{self.restore_fallbacks() - fell0} memory restore(s) refused: fell back")
            self.shm_file.unlink(missing_ok=True)
        f.t_end = time.time()
        ok = self.wait("recovery", lambda: self._recovered(f, gen0, saves0), self.deadline_s)
        if f.kind is Kind.HANG and self.hang_file is not None:
            self.hang_file.unlink(missing_ok=True)
            if f.recovered_at is not None and self._hang_reports() <= caught0:
                self.violations.append(f"hang ({f.target}) at +{f.t_start - self.t0:.0f}s: the round restarted "
                                       "but no agent reported it hung (--hang-timeout did not fire)")
        if not ok:
            self.hang(f"{f.kind.value} ({f.target}) at +{f.t_start - self.t0:.0f}s: no "
                      f"{f.recovery.value} within {self.deadline_s:.0f}s of the fault's end (hang)")
            return
        # Steady state before the next fault: every live node in the newest generation, which trains.
        if self.wait("full strength", self._settled, self.deadline_s):
            f.full_at = time.time()
        elif not self.aborted:
            self.hang(f"{f.kind.value} ({f.target}) at +{f.t_start - self.t0:.0f}s: the job did not return to "
                      f"all {len(self.launcher.live())} live nodes within {self.deadline_s:.0f}s (hang)")

    def hang(self, message: str) -> None:
        """Record a hang; stop the soak, or with ``keep_going`` kill every agent and start the slots afresh."""
        self.violations.append(message)
        self.log(f"!! {message}")
        if not self.keep_going:
            self.aborted = True
            return
        slots = sorted({a.slot for a in self.launcher.live()})
        for a in self.launcher.live():
            a.expected_exit = True
            kill_tree(a.pid)
        self.forced_restarts += 1
        gen0 = self.newest_gen
        for slot in slots:
            self.launcher.start(slot)
        self.log(f"!! killed every agent and started slots {slots} afresh (--keep-going)")
        fresh = lambda: any(r["ev"] == "step" and (gen0 is None or gen_of(r) > gen0)  # noqa: E731
                            for r in self.tail.records[-200:])
        if not self.wait("a fresh job", fresh, self.deadline_s):
            self.violations.append("a job started afresh after a hang did not train either; giving up")
            self.aborted = True

    def _settled(self) -> bool:
        gen = self.newest_gen
        steps = {(int(r["step"]), int(r["world"])) for r in self.tail.records[self._scan_from:]
                 if r["ev"] == "step" and gen_of(r) == gen}
        return len(steps) >= 3 and all(w == len(self.launcher.live()) for _, w in steps)

    def _current_workers(self) -> List[Tuple[int, str]]:
        """(pid, node) of the live workers of the newest generation, from their audit ``start`` lines."""
        out = []
        for r in self.tail.records:
            if r["ev"] == "start" and gen_of(r) == self.newest_gen and _alive(int(r["pid"])):
                out.append((int(r["pid"]), str(r["node"])))
        return sorted(set(out))

    def _hang_reports(self) -> int:
        """How many times the agents' logs say a round was stopped as hung (so far)."""
        n = 0
        for a in self.launcher.agents:
            try:
                text = a.log_path.read_text(errors="replace")
            except OSError:
                continue
            n += sum(text.count(m) for m in HANG_MARKS)
        return n

    def _save_failures(self) -> int:
        return self._count("save_failed")

    def restore_fallbacks(self) -> int:
        """Checkpoints that workers' ``load_latest`` gave up on (then loaded an older one)."""
        return self._count("restore_fallback")

    def _count(self, event: str) -> int:
        return sum(1 for r in self.tail.records if r["ev"] == event)

    def _recovered(self, f: Fault, gen0: Optional[Gen], saves0: int) -> bool:
        if f.recovery is Recovery.REUSED:
            return True  # decided by the fault itself (recovered_at set when the reused id's job succeeded)
        if f.recovery is Recovery.CHECKPOINT:
            later = [r for r in self.saves_seen[saves0:] if r["t"] > f.t_ref]
            if later:
                f.recovered_at = later[0]["t"]
        else:
            # the first qualifying step after the fault's end
            for r in self.tail.records[self._scan_from:]:
                if r["ev"] != "step" or r["t"] <= f.t_ref:
                    continue
                if f.recovery is Recovery.NEW_GENERATION and (
                        (gen0 is not None and gen_of(r) <= gen0) or self.gen_started[gen_of(r)] <= f.t_start):
                    continue  # a round formed before the fault (e.g. still re-forming after the last one)
                f.recovered_at = r["t"]
                break
        return f.recovered_at is not None

    # -- the end -----------------------------------------------------------------------

    def finish(self, stop_file: Path, margin: int, timeout: float) -> None:
        """Tell every worker the last step, wait for the job to end, check every agent's exit code."""
        steps = [int(r["step"]) for r in self.tail.records if r["ev"] == "step"]
        stop_at = (max(steps) if steps else 0) + margin
        tmp = stop_file.with_suffix(".tmp")
        tmp.write_text(str(stop_at))
        os.replace(tmp, stop_file)
        self.log(f"ending the job at step {stop_at}")
        self.finishing = True
        done = self.wait("the job to end", lambda: not self.launcher.live(), timeout)
        if not done:
            self.violations.append(f"the job did not end within {timeout:.0f}s of asking it to stop at step "
                                   f"{stop_at} (hang); still running: "
                                   + ", ".join(f"slot{a.slot}.{a.incarnation}" for a in self.launcher.live()))
        for a in self.launcher.agents:
            rc = a.proc.poll()
            if not a.expected_exit and rc not in (0, None):
                self.violations.append(f"agent slot{a.slot}.{a.incarnation} ended with code {rc}: "
                                       f"{_last_lines(a.log_path, 3)}")
            a.expected_exit = True
        self.pump()


def _write(path: Path, text: str) -> None:
    """Replace ``path``'s content atomically (workers poll it)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _last_lines(path: Path, n: int) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip()[:200] for line in lines[-n:])


__all__ = ["AgentProc", "NODE_SLOTS", "Soak", "Tail"]
