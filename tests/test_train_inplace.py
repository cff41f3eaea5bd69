"""In-place re-forming, worker side: real gloo workers, real files, a real TCPStore per round.

The test plays the agent: it publishes each worker's next assignment with
:func:`~elasticrun.train.inplace.write_assignment` (exactly what an agent writes) and starts
newcomers with ``ELASTICRUN_INPLACE_JOIN=1``. Checked: survivors keep their PIDs through a join
(2 → 3) and a graceful leave (3 → 2), no step and no sample runs twice, the newcomer receives the
survivors' parameters, the pause is measured, and failures end in exit 75 (no hang). A peer's
crash mid-step: the survivors leave the broken group, wait for the agent's word
(:func:`~elasticrun.job.inplace.announce_recovery`), re-form with the crashed rank's replacement
and redo the interrupted step; without the word they exit for a restart. On a host with two or more
GPUs (marked ``gpu``) the crash also runs over NCCL, one GPU per slot.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from elasticrun.job import env as names
from elasticrun.job.inplace import announce_recovery
from elasticrun.store.server import free_port
from elasticrun.train.inplace import EXIT_INPLACE_FAILED, opted_in, write_assignment
from tests.helpers.inplace import steps_by_process
from tests.helpers.procs import REPO, SCRIPTS, wait_until, worker_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class Harness:
    """Rounds of workers on one machine, re-formed in place the way an agent does it."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.log = tmp / "steps.jsonl"
        self.stores: List[dist.TCPStore] = []
        self.procs: Dict[int, subprocess.Popen] = {}  # by slot (a stable worker id)
        self.round = -1
        self.capture = False  # the workers' stderr goes to :meth:`stderr` files (else: the test's own)

    def _store(self) -> int:
        port = free_port()
        self.stores.append(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False))
        return port

    def _env(self, rank: int, world: int, port: int, prev: int) -> Dict[str, str]:
        return {names.RANK: str(rank), names.WORLD_SIZE: str(world), names.LOCAL_RANK: "0",
                names.LOCAL_WORLD_SIZE: "1", names.GROUP_RANK: str(rank), names.GROUP_WORLD_SIZE: str(world),
                names.ROLE_RANK: str(rank), names.ROLE_WORLD_SIZE: str(world), names.MASTER_ADDR: "127.0.0.1",
                names.MASTER_PORT: str(port), names.RESTART_COUNT: "0", names.ROUND: str(self.round),
                names.PREV_WORLD_SIZE: str(prev), names.RESCALE_TYPE: "ScaleUp" if prev else "Start"}

    def inplace_file(self, slot: int) -> str:
        return str(self.tmp / f"reform-{slot}")

    def start(self, slot: int, rank: int, world: int, port: int, prev: int = 0, **extra: str) -> None:
        env = worker_env({**self._env(rank, world, port, prev), names.USE_AGENT_STORE: "True",
                          names.INPLACE_FILE: self.inplace_file(slot), "INPLACE_LOG": str(self.log),
                          "PYTHONPATH": str(REPO), **extra})
        env.pop(names.RDZV_ID, None)  # no etcd here: no commit fence
        if not self.capture:
            self.procs[slot] = subprocess.Popen([sys.executable, str(SCRIPTS / "inplace_worker.py")], env=env)
            return
        with open(self.stderr(slot), "ab") as err:
            self.procs[slot] = subprocess.Popen([sys.executable, str(SCRIPTS / "inplace_worker.py")], env=env,
                                                stderr=err)

    def stderr(self, slot: int) -> Path:
        """Where slot ``slot``'s workers write their stderr (with :attr:`capture`)."""
        return self.tmp / f"stderr-{slot}"

    def first_round(self, slots: List[int], extra: Optional[Dict[int, Dict[str, str]]] = None) -> None:
        self.round = 0
        port = self._store()
        for rank, slot in enumerate(slots):
            self.start(slot, rank, len(slots), port, **(extra or {}).get(slot, {}))
        wait_until(lambda: all(opted_in(self.inplace_file(s)) for s in slots), 60, "workers opting in")

    def next_round(self, survivors: List[int], newcomers: List[int], prev: int, **extra: str) -> None:
        """Ranks: survivors first in their old order (stable), newcomers after."""
        self.round += 1
        port = self._store()
        world = len(survivors) + len(newcomers)
        for rank, slot in enumerate(survivors):
            write_assignment(self.inplace_file(slot), self._env(rank, world, port, prev))
        for i, slot in enumerate(newcomers):
            self.start(slot, len(survivors) + i, world, port, prev, **{names.INPLACE_JOIN: "1", **extra})

    def replace_slot_1_and_finish(self, **extra: str) -> None:
        """The agent's next round after slot 1 of three went: the same ranks, slot 1's replacement joins as a
        newcomer (``extra``: its environment); every worker then trains to the end and exits 0."""
        self.round += 1
        port = self._store()
        for rank in (0, 2):
            write_assignment(self.inplace_file(rank), self._env(rank, 3, port, 3))
        self.start(1, 1, 3, port, 3, **{names.INPLACE_JOIN: "1", **extra})
        for s in (0, 1, 2):
            assert self.procs[s].wait(timeout=90) == 0

    def records(self) -> List[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def steps(self) -> List[dict]:
        return [r for r in self.records() if "step" in r]

    def at_world(self, world: int, n: int = 1) -> bool:
        return sum(1 for r in self.steps() if r["world"] == world and r["round"] == self.round) >= n

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def harness(tmp_path: Path):
    h = Harness(tmp_path)
    yield h
    h.close()


def test_join_then_graceful_leave_keeps_survivors_and_exactly_once(harness: Harness) -> None:
    h = harness
    h.first_round([0, 1])
    wait_until(lambda: h.at_world(2, 4), 60, "steps at world 2")
    pids = {s: h.procs[s].pid for s in (0, 1)}
    h.next_round([0, 1], [2], prev=2)  # join: 2 -> 3
    wait_until(lambda: h.at_world(3, 6), 60, "steps at world 3")
    h.procs[1].send_signal(signal.SIGTERM)  # graceful leave of the middle rank
    assert h.procs[1].wait(timeout=30) == 0
    h.next_round([0, 2], [], prev=3)  # ranks stay in order: 0 -> 0, 2 -> 1
    for s in (0, 2):
        assert h.procs[s].wait(timeout=60) == 0
    steps = h.steps()
    # Survivors kept their processes: one PID per slot across all rounds.
    assert {r["pid"] for r in steps if r["round"] == 0} == set(pids.values())
    assert {r["pid"] for r in steps if r["round"] == 2} == {pids[0], h.procs[2].pid}
    # No step twice: per (pid) the steps are strictly increasing by one, and the newcomer
    # started right after the survivors' last step (it got `step` by broadcast).
    by_pid = steps_by_process(steps)
    first_new = by_pid[h.procs[2].pid][0]
    assert first_new == max(r["step"] for r in steps if r["round"] == 0) + 1
    # Every sample exactly once across the three world sizes.
    seen = [i for r in steps for i in r["idx"]]
    assert sorted(seen) == list(range(120))
    # Same parameters on every rank after each step (the newcomer got the survivors' model).
    for step in {r["step"] for r in steps}:
        ws = [r["w"] for r in steps if r["step"] == step]
        assert all(w == pytest.approx(ws[0]) for w in ws)
    pauses = [r["reformed"] for r in h.records() if "reformed" in r]
    assert len(pauses) == 4  # two survivors re-formed twice each
    print(f"in-place re-form pauses (s): {sorted(pauses)}")
    # The restart path with the same global batch, changing world size after the same steps: fresh
    # processes per round, the state handed over through a file. Same parameters after every step.
    changes = [max(r["step"] for r in steps if r["round"] == n) for n in (0, 1)]
    ref = restart_reference(h, [(2, changes[0]), (3, changes[1]), (2, 0)])
    mine = {r["step"]: r["w"] for r in steps if r["rank"] == 0}
    assert sorted(ref) == sorted(mine), "the same steps on both paths"
    for step, w in mine.items():
        assert w == pytest.approx(ref[step], rel=1e-5, abs=1e-6), f"step {step}: in place != restart path"


def restart_reference(h: Harness, segments: List[Tuple[int, int]]) -> Dict[int, List[float]]:
    """Run ``segments`` of (world size, last step; 0: to the end) as fresh workers each; step → rank 0's weights."""
    log, state = h.tmp / "reference.jsonl", h.tmp / "reference.pt"
    for world, stop_after in segments:
        h.round += 1
        port = h._store()
        slots = [100 + h.round * 10 + rank for rank in range(world)]
        for rank, slot in enumerate(slots):
            h.start(slot, rank, world, port, **{names.INPLACE_FILE: "", "INPLACE_LOG": str(log), "INPLACE_PACE": "0",
                                                "INPLACE_RESUME": str(state), "INPLACE_STOP_AFTER": str(stop_after)})
        assert [h.procs[s].wait(timeout=60) for s in slots] == [0] * world
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return {r["step"]: r["w"] for r in rows if r["rank"] == 0}


@pytest.mark.parametrize("failure", ["newcomer-sync", "survivor-reform"])
def test_failure_during_reform_exits_for_restart(harness: Harness, failure: str) -> None:
    h = harness
    quick = {"INPLACE_JOIN_TIMEOUT": "15"}  # bounds the wait for a peer that will never come
    die = {"INPLACE_DIE": "reform:0"} if failure == "survivor-reform" else {}
    short = {"INPLACE_REFORM_TIMEOUT": "6"} if failure == "survivor-reform" else {}
    h.first_round([0, 1], {0: {**quick, **short}, 1: {**quick, **die, **short}})
    wait_until(lambda: h.at_world(2, 2), 60, "steps at world 2")
    if failure == "newcomer-sync":
        h.next_round([0, 1], [2], prev=2, INPLACE_DIE="sync", **quick)
        assert h.procs[2].wait(timeout=60) == 3
        codes = [h.procs[s].wait(timeout=60) for s in (0, 1)]
    else:
        # Survivor 1 dies inside its re-form; the others cannot complete the new group. Nobody comes: the
        # waits are shorter (survivor 0 set INPLACE_REFORM_TIMEOUT at its start, the newcomer its init's).
        h.next_round([0, 1], [2], prev=2, INPLACE_JOIN_TIMEOUT="6")
        assert h.procs[1].wait(timeout=60) == 4
        assert h.procs[2].wait(timeout=60) != 0  # the newcomer's own init times out: a normal failure
        codes = [h.procs[0].wait(timeout=60)]
    assert all(c == EXIT_INPLACE_FAILED for c in codes), codes


def test_sigterm_while_waiting_for_an_assignment_leaves(harness: Harness) -> None:
    """A worker that agreed to re-form, then is told to leave while no assignment comes (its agent
    left the job first), leaves with STOP (exit 0) instead of waiting out its timeout (exit 75)."""
    h = harness
    h.first_round([0, 1])
    wait_until(lambda: h.at_world(2, 2), 60, "steps at world 2")
    h.round += 1
    write_assignment(h.inplace_file(0), h._env(0, 1, h._store(), 2))  # only slot 0 has a place
    wait_until(lambda: any("reformed" in r for r in h.records()), 60, "slot 0 re-formed alone")
    h.procs[1].send_signal(signal.SIGTERM)  # slot 1 left the old group at the same step and waits
    assert h.procs[1].wait(timeout=30) == 0
    assert h.procs[0].wait(timeout=60) == 0  # the survivor finishes the epoch alone


def _crash_mid_step(h: Harness, announce: bool, **extra: str) -> Tuple[Dict[int, int], Path]:
    """Three workers; slot 1 dies between the two gradient all-reduces of a step. ``announce``: the test
    (as the agent) tells the survivors it keeps them (and that the round broke). ``extra``: every
    worker's environment. The slots' PIDs and the crash trigger file."""
    trigger = h.tmp / "crash-mid"
    h.first_round([0, 1, 2], {s: {**extra, **({"INPLACE_CRASH_MID_FILE": str(trigger)} if s == 1 else {})}
                              for s in (0, 1, 2)})
    wait_until(lambda: h.at_world(3, 3), 60, "steps at world 3")
    pids = {s: h.procs[s].pid for s in (0, 1, 2)}
    trigger.touch()
    assert h.procs[1].wait(timeout=30) == 1
    if announce:
        for slot in (0, 2):
            announce_recovery(h.inplace_file(slot), h.round, 60.0, broken=True)
    return pids, trigger


@pytest.mark.parametrize("watch", [False, True], ids=["gloo", "abort-watch"])
def test_crash_mid_step_survivors_recover_in_place_and_redo_the_step(harness: Harness, watch: bool) -> None:
    """``abort-watch``: the NCCL path over gloo (``INPLACE_WATCH=1``): the round's groups are aborted (by
    the survivor's own error or the watch on the word), destroyed without a device synchronisation,
    the new round's groups armed, and every optimizer step passes the hook."""
    h = harness
    extra = {"INPLACE_WATCH": "1"} if watch else {}
    pids, _ = _crash_mid_step(h, announce=True, **extra)
    h.replace_slot_1_and_finish(**extra)
    steps = h.steps()
    recovered = [r for r in h.records() if "recovered" in r]
    assert {r["pid"] for r in recovered} == {pids[0], pids[2]}
    assert all(r["recovered"] == "reformed" and r["round"] == 1 for r in recovered), recovered
    print(f"crash recovery pauses (s, incl. the replacement's start-up): {[r['pause'] for r in recovered]}")
    # The survivors kept their processes; the replacement is a new one.
    assert {r["pid"] for r in steps if r["round"] == 1 and r["rank"] in (0, 2)} == {pids[0], pids[2]}
    assert h.procs[1].pid != pids[1]
    # The interrupted step ran once: per process strictly consecutive steps, every step of the job once
    # on rank 0, and every sample exactly once (the crashed rank's samples of that step included).
    steps_by_process(steps)
    rank0 = [r["step"] for r in steps if r["rank"] == 0]
    assert rank0 == list(range(1, len(rank0) + 1))
    assert sorted(i for r in steps for i in r["idx"]) == list(range(120))
    for step in {r["step"] for r in steps}:  # the replacement trains with the survivors' model
        ws = [r["w"] for r in steps if r["step"] == step]
        assert all(w == pytest.approx(ws[0]) for w in ws)


def test_survivors_blocked_on_a_stuck_peer_are_woken_by_the_agents_word_over_gloo(harness: Harness) -> None:
    """A gloo collective does not always fail when its round breaks: a peer that is alive but stuck (or, as
    the chaos soak showed, one killed between two collectives) leaves it waiting for the group's timeout.
    The agent's word that the round broke (a lost node, a crash) cuts the round's connections, so the
    survivors recover in place at once; the replacement joins and every worker finishes."""
    h = harness
    h.capture = True
    hang = h.tmp / "hang"
    slow = {"INPLACE_TIMEOUT": "60", "INPLACE_JOIN_TIMEOUT": "120"}  # nothing times out within the test's bound
    h.first_round([0, 1, 2], {0: slow, 1: {**slow, "INPLACE_HANG_FILE": str(hang)}, 2: slow})
    wait_until(lambda: h.at_world(3, 3), 60, "steps at world 3")
    pids = {s: h.procs[s].pid for s in (0, 1, 2)}
    hang.touch()
    last = {}
    def stuck() -> bool:  # slot 1 stopped after its step N (it says so); the others logged N too and vote
        if not (h.tmp / "hang.stuck").exists():
            return False
        steps = [r for r in h.steps() if r["round"] == 0]
        last.update({r["pid"]: r["step"] for r in steps})
        return len(last) == 3 and len(set(last.values())) == 1
    wait_until(stuck, 30, "every rank at the step slot 1 stopped after")
    for slot in (0, 2):
        announce_recovery(h.inplace_file(slot), h.round, 60.0, broken=True)
    # Well before the collectives' own timeout (60 s):
    wait_until(lambda: all(WAITING in h.stderr(s).read_text(errors="replace") for s in (0, 2)), 20,
               "the survivors leaving the broken round")
    assert h.procs[1].poll() is None, "the stuck peer is alive: only the word ended the collectives"
    h.procs[1].kill()  # the stuck node is gone: its replacement joins the next round
    h.procs[1].wait()
    h.replace_slot_1_and_finish(**slow)
    # They waited in the step boundary's vote: InPlace.check re-formed them (a "reformed" line each).
    records = h.records()
    reformed = [r for r in records if "reformed" in r]
    assert {r["pid"] for r in reformed} == {pids[0], pids[2]} and {r["round"] for r in reformed} == {1}, (
        [r for r in records if "step" not in r],  # on failure only: what they wrote instead
        *(h.stderr(s).read_text(errors="replace")[-3000:] for s in (0, 2)))
    steps = h.steps()
    assert {r["pid"] for r in steps if r["round"] == 1 and r["rank"] in (0, 2)} == {pids[0], pids[2]}
    assert sorted(i for r in steps for i in r["idx"]) == list(range(120)), "every sample exactly once"


def test_crash_mid_step_without_a_recovery_exits_for_a_restart(harness: Harness) -> None:
    """No word from the agent within the worker's ``timeout`` (5 s in the test worker): the step's error
    is re-raised (exit 1, a plain failure: the restart path), never a wait for the group's timeout."""
    h = harness
    _crash_mid_step(h, announce=False)
    codes = [h.procs[s].wait(timeout=60) for s in (0, 2)]
    assert codes == [1, 1], codes
    assert not any("recovered" in r for r in h.records())


WAITING = "waiting for an in-place recovery"  # InPlace.recover's line once its collective failed
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0  # read at collection: the host's GPUs


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2 or not dist.is_nccl_available(),
                    reason=f"a crash over NCCL needs one CUDA GPU per rank (this host: {GPUS} GPUs)")
def test_crash_mid_step_over_nccl_survivors_abort_and_recover(harness: Harness) -> None:
    """The same crash over NCCL, one GPU per slot: the survivors' second all-reduce waits on the dead
    peer on the device and their CPU waits in the optimizer step's hook; the agent's word that the round
    broke (``broken=True``) makes their watch abort the communicators, the step is refused (its partial
    all-reduce never reaches the parameters) and they re-form with the replacement, redoing it once."""
    h = harness
    n = min(GPUS, 3)
    slots = list(range(n))
    gpu = {s: {"CUDA_VISIBLE_DEVICES": str(s), "INPLACE_JOIN_TIMEOUT": "60"} for s in slots}
    trigger = h.tmp / "crash-mid"
    h.first_round(slots, {s: {**gpu[s], **({"INPLACE_CRASH_MID_FILE": str(trigger)} if s == 1 else {})}
                          for s in slots})
    wait_until(lambda: h.at_world(n, 3 * n), 90, f"steps at world {n}")
    pids = {s: h.procs[s].pid for s in slots}
    trigger.touch()
    assert h.procs[1].wait(timeout=30) == 1
    survivors = [s for s in slots if s != 1]
    began = time.monotonic()
    for slot in survivors:
        announce_recovery(h.inplace_file(slot), h.round, 60.0, broken=True)
    wait_until(lambda: {r["pid"] for r in h.records() if "recovered" in r} == {pids[s] for s in survivors}, 60,
               "the survivors woken from the NCCL collective (long before its 60 s timeout)")
    woken = time.monotonic() - began
    h.round += 1
    port = h._store()
    for rank in survivors:
        write_assignment(h.inplace_file(rank), h._env(rank, n, port, n))
    h.start(1, 1, n, port, n, **{names.INPLACE_JOIN: "1", **gpu[1]})
    for s in slots:
        assert h.procs[s].wait(timeout=120) == 0
    assert woken < 30, f"woken after {woken:.1f} s"
    steps = h.steps()
    assert {r["backend"] for r in steps} == {"nccl"}
    recovered = [r for r in h.records() if "recovered" in r]
    assert all(r["recovered"] == "reformed" and r["round"] == 1 for r in recovered), recovered
    assert {r["pid"] for r in steps if r["round"] == 1 and r["rank"] != 1} == {pids[s] for s in survivors}
    steps_by_process(steps)
    rank0 = [r["step"] for r in steps if r["rank"] == 0]
    assert rank0 == list(range(1, len(rank0) + 1)), "no step twice, none skipped"
    assert sorted(i for r in steps for i in r["idx"]) == list(range(120)), "every sample once"
    for step in {r["step"] for r in steps}:  # the refused step left no partial all-reduce in any model
        ws = [r["w"] for r in steps if r["step"] == step]
        assert all(w == pytest.approx(ws[0]) for w in ws), f"step {step}: ranks differ"
