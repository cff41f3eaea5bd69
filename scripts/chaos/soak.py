"""The chaos soak's run loop: start the job, inject each scheduled fault, wait for its recovery."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from elasticrun.checkpoint import verify
from elasticrun.errors import ElasticrunError

from .audit import Gen, Tail, gen_of
from .env import AgentProc, Machine, alive, last_lines, write_atomic
from .kinds import Fault, Recovery


@dataclass
class Soak:
    """State of one soak run; ``violations`` collects every broken invariant."""

    machine: Machine
    tail: Tail
    deadline_s: float
    log: Callable[[str], None]
    violations: List[str] = field(default_factory=list)
    faults: List[Fault] = field(default_factory=list)
    newest_gen: Optional[Gen] = None
    step_gen: Gen = (-1, -1)  # the generation of the newest step line
    last_step_t: float = 0.0
    checks: Counter = field(default_factory=Counter)  # checkpoints verified, failed, retired (removed before)
    aborted: bool = False
    finishing: bool = False
    t0: float = 0.0
    nodes: int = 0  # at the start
    gen_started: Dict[Gen, float] = field(default_factory=dict)  # first audit line of each generation
    latest: Dict[int, dict] = field(default_factory=dict)  # each worker's (pid's) last audit line
    _scan_from: int = 0

    def pump(self) -> None:
        """Read new audit lines, verify new checkpoints, restart agents that died on their own."""
        for r in self.tail.poll():
            g = gen_of(r)
            self.gen_started.setdefault(g, r["t"])
            self.newest_gen = max(g, self.newest_gen or g)
            self.latest[int(r["pid"])] = r
            if r["ev"] == "step":
                self.last_step_t = max(self.last_step_t, r["t"])
                self.step_gen = max(self.step_gen, g)
            if r["ev"] == "save" and int(r["rank"]) == 0:
                self._verify(str(r["name"]))
        if self.finishing:
            return  # agents end now; finish() checks their exit codes
        for a in list(self.machine.agents):
            rc = a.proc.poll()
            if rc is None or a.expected_exit:
                continue
            a.expected_exit = True
            self.violations.append(f"agent {a.label} exited with code {rc} on its own at "
                                   f"+{time.time() - self.t0:.0f}s: {last_lines(a.log_path, 3)}")
            if len([b for b in self.machine.agents if b.slot == a.slot and b.started > time.time() - 60]) >= 3:
                self.violations.append(f"slot{a.slot}: 3 agents exited within a minute; giving up")
                self.aborted = True
                return
            self.log(f"!! agent {a.label} exited rc={rc}; starting a new one for the slot")
            self.machine.start(a.slot)

    def _verify(self, name: str) -> None:
        """Verify a checkpoint right after its commit; one that retention removed first counts as retired."""
        try:
            problem = "; ".join(verify(str(self.machine.ckpt_root), name).problems)
        except ElasticrunError as err:
            problem = str(err) or type(err).__name__
        if not (self.machine.ckpt_root / name).exists():
            self.checks["retired"] += 1
        elif problem:
            self.checks["failed"] += 1
            self.violations.append(f"checkpoint {name} failed verification: {problem[:300]}")
        else:
            self.checks["verified"] += 1

    def wait(self, cond: Callable[[], bool], timeout: float) -> bool:
        """Pump until ``cond()`` holds (True) or ``timeout`` seconds passed (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.aborted:
            self.pump()
            if cond():
                return True
            time.sleep(0.2)
        self.pump()
        return cond()

    def sleep(self, seconds: float) -> None:
        self.wait(lambda: False, seconds)

    def live_agents(self) -> List[AgentProc]:
        """Running agents not stopped by a fault right now."""
        return [a for a in self.machine.live() if not a.stopped]

    def current_workers(self) -> List[Tuple[int, str]]:
        """(pid, node) of the live workers whose last audit line is of the newest generation."""
        return sorted((pid, str(r["node"])) for pid, r in self.latest.items()
                      if gen_of(r) == self.newest_gen and alive(pid))

    def rank0_node(self) -> Optional[str]:
        """The node of the newest generation's rank 0, if one logged yet."""
        return next((str(r["node"]) for r in self.latest.values()
                     if gen_of(r) == self.newest_gen and int(r["rank"]) == 0), None)

    def count(self, event: str) -> int:
        return sum(1 for r in self.tail.records if r["ev"] == event)

    def log_counts(self, text: str) -> Dict[str, int]:
        """How many times each agent's log holds ``text`` (agents whose log does not are left out)."""
        counts = {a.label: a.log_path.read_text(errors="replace").count(text) for a in self.machine.agents
                  if a.log_path.exists()}
        return {label: n for label, n in counts.items() if n}

    def run(self, nodes: int, faults: Iterator[Fault], seconds: float) -> None:
        """Start the job, inject ``faults`` for ``seconds``, end the job."""
        self.t0, self.nodes = time.time(), nodes
        for slot in range(nodes):
            self.machine.start(slot)
        if not self.wait(self.settled, 240):  # the faults' rounds are those formed after the start's
            self.hang(f"the job did not train at all {nodes} nodes within 240 s of starting")
        self.wait(self.machine.offer_inplace, 60)  # the first fault meets a job that can recover in place
        end = time.monotonic() + seconds
        while not self.aborted and time.monotonic() < end:
            f = next(faults)
            self.faults.append(f)
            self.inject(f)
            if f.skipped:
                self.log(f"  {f.kind.name}: skipped ({f.skipped})")
                continue
            ttr = "-" if f.ttr is None else f"{f.ttr:.1f}s"
            self.log(f"+{f.t_start - self.t0:6.1f}s {f.kind.name:<13} {f.target}: recovered in {ttr} "
                     f"{'; '.join(f.notes)}")
            self.sleep(f.gap)
            if time.time() - self.last_step_t > self.deadline_s:
                self.hang(f"no training step for {self.deadline_s:.0f}s between faults (hang)")
        if not self.aborted:
            self.finish()

    def inject(self, f: Fault) -> None:
        """Apply one fault, heal it, wait for its recovery and then for the job at full strength."""
        f.t_start = time.time()
        self._scan_from = len(self.tail.records)
        gen0 = self.newest_gen
        f.kind.inject(self, f)
        if f.skipped:
            return
        f.t_end = time.time()
        ok = self.wait(lambda: self._recovered(f, gen0), self.deadline_s)
        f.kind.check(self, f)
        where = f"{f.kind.name} ({f.target}) at +{f.t_start - self.t0:.0f}s"
        if not ok:
            self.hang(f"{where}: no recovery ({f.kind.recovery.value}) within {self.deadline_s:.0f}s of its end (hang)")
        elif self.wait(self.settled, self.deadline_s):
            f.full_at = time.time()
        elif not self.aborted:
            self.hang(f"{where}: the job did not return to all {len(self.machine.live())} live nodes within "
                      f"{self.deadline_s:.0f}s (hang)")

    def hang(self, message: str) -> None:
        self.violations.append(message)
        self.log(f"!! {message}")
        self.aborted = True

    def settled(self) -> bool:
        """Steady state: every live node in the newest generation, which trains."""
        steps = {(int(r["step"]), int(r["world"])) for r in self.tail.records[self._scan_from:]
                 if r["ev"] == "step" and gen_of(r) == self.newest_gen}
        return len(steps) >= 3 and all(w == len(self.machine.live()) for _, w in steps)

    def _recovered(self, f: Fault, gen0: Optional[Gen]) -> bool:
        """Set ``f.recovered_at`` from the first audit line after ``f.t_ref`` that its kind's recovery asks for."""
        want = f.kind.recovery
        if want is Recovery.REUSED:  # the fault itself set recovered_at
            return True
        for r in self.tail.records[self._scan_from:]:
            if r["t"] <= f.t_ref:
                continue
            if want is Recovery.CHECKPOINT:
                hit = r["ev"] == "save" and int(r["rank"]) == 0
            else:  # a new round: not one formed before the fault (e.g. still re-forming after the last one)
                hit = r["ev"] == "step" and (want is Recovery.ANY_STEP or (
                    (gen0 is None or gen_of(r) > gen0) and self.gen_started[gen_of(r)] > f.t_start))
            if hit:
                f.recovered_at = r["t"]
                return True
        return False

    def finish(self) -> None:
        """Tell every worker the last step, wait for the job to end, check every agent's exit code."""
        steps = [int(r["step"]) for r in self.tail.records if r["ev"] == "step"]
        stop_at, timeout = (max(steps) if steps else 0) + 30, self.deadline_s
        write_atomic(self.machine.stop_file, str(stop_at))
        self.log(f"ending the job at step {stop_at}")
        self.finishing = True
        if not self.wait(lambda: not self.machine.live(), timeout):
            self.violations.append(f"the job did not end within {timeout:.0f}s of asking it to stop at step "
                                   f"{stop_at} (hang); still running: "
                                   + ", ".join(a.label for a in self.machine.live()))
        for a in self.machine.agents:
            rc = a.proc.poll()
            if not a.expected_exit and rc not in (0, None):
                self.violations.append(f"agent {a.label} ended with code {rc}: {last_lines(a.log_path, 3)}")
            a.expected_exit = True
        self.pump()
