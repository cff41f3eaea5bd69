"""Waking a survivor whose NCCL collective waits on a crashed peer: the decisions, with fake groups.

The abort itself (``abort_all_groups``: torch's ``ProcessGroup.abort``) needs NCCL to mean anything; here
``cut`` and ``abort`` are fakes that record their calls, and the clock is the test's own polling."""

from __future__ import annotations

import threading
from typing import List

import pytest
import torch
import torch.distributed as dist

from elasticrun.train import abort
from elasticrun.train.abort import BreakWatch, RoundAbort, finish


class Groups:
    """A round's fake groups: what was done to them, in order."""

    def __init__(self) -> None:
        self.calls: List[str] = []
        self.aborted = threading.Event()

    def cut(self) -> int:
        self.calls.append("cut")
        return 2

    def abort(self) -> None:
        self.calls.append("abort")
        self.aborted.set()


class Agent:
    """The agent's word (``<file>.recover`` with ``broken``), per round."""

    def __init__(self) -> None:
        self.broken_rounds: set = set()
        self.asked: List[int] = []

    def broken(self, round_: int) -> bool:
        self.asked.append(round_)
        return round_ in self.broken_rounds


def test_a_round_is_aborted_once_connections_first() -> None:
    g = Groups()
    ra = RoundAbort(3, g.cut, g.abort)
    assert not ra.fired
    assert ra.fire() is True
    assert ra.fire() is False, "a second caller does nothing"
    assert g.calls == ["cut", "abort"], "gloo connections cut, then the backends aborted, once"
    assert ra.cut_count == 2, "how many connections the cut shut down is kept for the log"


def test_fired_is_set_before_the_abort_runs() -> None:
    """A thread that the abort wakes (the step's synchronize returns) must already see ``fired``."""
    seen = []
    ra: RoundAbort

    def abort() -> None:
        seen.append(ra.fired)

    ra = RoundAbort(0, lambda: 0, abort)
    ra.fire()
    assert seen == [True]


def test_a_failing_cut_still_aborts_and_keeps_the_error() -> None:
    g = Groups()

    def cut() -> int:
        raise OSError("gone")

    ra = RoundAbort(1, cut, g.abort)
    assert ra.fire()
    assert g.calls == ["abort"] and isinstance(ra.error, OSError)


def test_concurrent_fires_abort_once() -> None:
    g = Groups()
    ra = RoundAbort(0, g.cut, g.abort)
    threads = [threading.Thread(target=ra.fire) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert g.calls == ["cut", "abort"]


def test_the_watch_fires_only_on_the_word_for_the_armed_round() -> None:
    g, agent, round_now = Groups(), Agent(), [3]
    w = BreakWatch(lambda: round_now[0], agent.broken)
    assert not w.poll() and agent.asked == [], "nothing armed (no groups yet): nothing to ask"
    w.arm(3, g.cut, g.abort)
    assert not w.poll() and not w.fired, "no word yet: the survivor trains on"
    agent.broken_rounds.add(2)
    assert not w.poll(), "a word about an older round ends nothing of this one"
    agent.broken_rounds.add(3)
    assert w.poll() and w.fired and g.calls == ["cut", "abort"]
    assert not w.poll() and g.calls == ["cut", "abort"], "once"


def test_a_rearm_race_never_aborts_the_new_rounds_groups() -> None:
    """The re-form updates the worker's round before it arms the new round: in between the armed abort is
    the old round's, and the word still names the old round."""
    old, new, agent, round_now = Groups(), Groups(), Agent(), [4]
    w = BreakWatch(lambda: round_now[0], agent.broken)
    w.arm(4, old.cut, old.abort)
    agent.broken_rounds.add(4)
    w.abort_now()  # the main thread's recover ended round 4 first
    round_now[0] = 5  # the re-form: the worker is in round 5, its groups are being formed
    assert not w.poll() and old.calls == ["cut", "abort"]
    w.arm(5, new.cut, new.abort)
    assert not w.fired and not w.poll() and new.calls == [], "round 5 trains on"


def test_a_planned_change_is_no_break() -> None:
    """A join or graceful leave also announces (``broken`` false): the survivors must train on."""
    g, round_now = Groups(), [0]
    w = BreakWatch(lambda: round_now[0], lambda r: False)
    w.arm(0, g.cut, g.abort)
    for _ in range(5):
        assert not w.poll()
    assert g.calls == []


def test_abort_now_without_an_armed_round_is_harmless() -> None:
    BreakWatch(lambda: 0, lambda r: True).abort_now()


class Refused(RuntimeError):
    pass


def test_the_gate_waits_for_the_steps_collectives_and_passes() -> None:
    g, waits = Groups(), []
    w = BreakWatch(lambda: 0, lambda r: False)
    w.arm(0, g.cut, g.abort)
    w.gate(lambda: waits.append(1), Refused)
    assert waits == [1], "the step's collectives ended before the update"


def test_the_gate_refuses_a_step_whose_collectives_were_aborted_while_it_waited() -> None:
    """The blocked synchronize returns because the abort ended the kernel: the gradients are partial."""
    g = Groups()
    w = BreakWatch(lambda: 0, lambda r: True)
    w.arm(0, g.cut, g.abort)
    with pytest.raises(Refused, match="not applied"):
        w.gate(lambda: w.poll(), Refused)
    with pytest.raises(Refused):
        w.gate(lambda: pytest.fail("no wait once aborted"), Refused)


def test_the_gate_is_an_optimizer_step_pre_hook_that_keeps_the_parameters() -> None:
    """Wired as InPlace wires it: the refused step raises a torch.distributed error (recover takes it)
    and the parameters are those before the step."""
    g = Groups()
    w = BreakWatch(lambda: 0, lambda r: True)
    w.arm(0, g.cut, g.abort)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.register_step_pre_hook(lambda *_: w.gate(lambda: w.poll(), dist.DistBackendError))
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(dist.DistBackendError) as refused:
        opt.step()
    assert isinstance(refused.value, RuntimeError), "a script's `except RuntimeError` catches it"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_thread_fires_on_the_word_and_stops() -> None:
    g, agent = Groups(), Agent()
    w = BreakWatch(lambda: 7, agent.broken, interval=0.005)
    w.arm(7, g.cut, g.abort)
    w.start()
    try:
        deadline = threading.Event()
        while len(agent.asked) < 3 and not deadline.wait(0.01):
            pass
        assert not g.aborted.is_set(), "no word: nothing aborted"
        agent.broken_rounds.add(7)
        assert g.aborted.wait(10), "the watch aborted the round on the agent's word"
    finally:
        w.stop()
    asked = len(agent.asked)
    assert w._thread is None
    threading.Event().wait(0.05)
    assert len(agent.asked) == asked, "stopped: no more looks"


def test_a_failing_look_does_not_end_the_watch() -> None:
    g, looks = Groups(), []

    def broken(r: int) -> bool:
        looks.append(r)
        if len(looks) == 1:
            raise ValueError("a torn file")
        return True

    w = BreakWatch(lambda: 0, broken, interval=0.005)
    w.arm(0, g.cut, g.abort)
    w.start()
    try:
        assert g.aborted.wait(10), "the look after the failed one fired"
    finally:
        w.stop()


class Work:
    """A collective's Work: still waiting for ``slices`` timed waits, then done (``error``: failed)."""

    def __init__(self, slices: int, error: Exception = None) -> None:
        self.slices, self.error, self.waits = slices, error, 0

    def wait(self, timeout=None) -> bool:
        self.waits += 1
        if self.waits <= self.slices and timeout is not None:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.waits > self.slices


def _watch(fired_ago: float = None) -> BreakWatch:
    """A started watch (the process's active one) whose round fired ``fired_ago`` seconds ago, or not."""
    g = Groups()
    w = BreakWatch(lambda: 0, lambda r: False, interval=60)
    w.arm(0, g.cut, g.abort)
    if fired_ago is not None:
        w.current.fire()
        w.current.fired_at -= fired_ago
    w.start()
    return w


def test_finish_returns_once_the_collective_ends_and_raises_its_failure() -> None:
    w = _watch()
    try:
        work = Work(slices=3)
        finish(work, group=object())
        assert work.waits == 4, "timed slices until it ended"
        with pytest.raises(RuntimeError, match="Connection closed"):
            finish(Work(slices=2, error=RuntimeError("Connection closed by peer")), group=object())
    finally:
        w.stop()


class LateWork(Work):
    """Ends just after its first timed wait gave up (the slice's timeout and the completion race)."""

    def is_completed(self) -> bool:
        return self.waits >= 1


def test_finish_takes_a_collective_that_ended_just_after_a_slice_timed_out() -> None:
    work = LateWork(slices=1)
    finish(work, abandon_s=2.0)  # the slice's "Operation timed out!" is not the collective's failure
    assert work.waits == 2
    failed = LateWork(slices=1, error=RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="closed by peer"):
        finish(failed, abandon_s=2.0)


def test_finish_waits_on_while_the_round_is_whole_or_only_just_cut() -> None:
    for fired_ago in (None, 0.0):
        w = _watch(fired_ago)
        try:
            work = Work(slices=2)
            finish(work, group=object(), abandon_s=60)
            assert work.waits == 3, "a collective of a whole round, or one just cut, is waited for"
        finally:
            w.stop()


def test_finish_gives_a_collective_up_once_the_cut_is_old_and_keeps_its_group() -> None:
    w = _watch(fired_ago=5.0)
    group = object()
    try:
        with pytest.raises(dist.DistBackendError, match="given up"):
            finish(Work(slices=10**6), group=group, abandon_s=2.0)
    finally:
        w.stop()
    assert any(g is group for g in abort._ABANDONED), "its group is kept: its destructor would join gloo's thread"


def test_finish_without_a_watch_waits_for_the_collective() -> None:
    work = Work(slices=3)
    finish(work, group=object(), abandon_s=0.0)
    assert work.waits == 4, "no watch (in-place off): nothing gives a collective up"
