"""A vote where some ranks stop: the others wait briefly for their own SIGTERM (a whole-job stop reaching
the nodes a little apart) unless their next assignment comes first (only some nodes leave)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from elasticrun.job import env as names
from elasticrun.job.inplace import write_assignment
from elasticrun.train.inplace import STOP_GRACE_S, InPlace


def _rank(tmp_path, timeout: float = 30.0) -> InPlace:
    """An InPlace of round 0 with nothing but what the wait reads (no process group)."""
    rank = InPlace.__new__(InPlace)
    rank.ctx = SimpleNamespace(should_stop=False, round=0)
    rank.path, rank._seen, rank.timeout = str(tmp_path / "assignment"), None, timeout
    return rank


def _later(seconds: float, action) -> None:
    threading.Timer(seconds, action).start()


def test_its_own_sigterm_ends_the_wait_at_once(tmp_path):
    rank = _rank(tmp_path)
    _later(0.2, lambda: setattr(rank.ctx, "should_stop", True))
    began = time.monotonic()
    assert rank._await_own_stop(False, False) == (True, False)
    assert time.monotonic() - began < STOP_GRACE_S


def test_the_next_rounds_assignment_ends_the_wait_at_once(tmp_path):
    rank = _rank(tmp_path)
    _later(0.2, lambda: write_assignment(rank.path, {names.ROUND: "1"}))
    began = time.monotonic()
    assert rank._await_own_stop(False, False) == (False, True)
    assert time.monotonic() - began < STOP_GRACE_S
    assert rank._await_own_stop(False, True) == (False, True), "an assignment already seen: no wait"


def test_a_stopping_rank_does_not_wait_and_the_others_give_up_after_the_grace(tmp_path):
    rank = _rank(tmp_path, timeout=0.6)  # the grace stays inside half the vote's deadline: 0.3 s here
    write_assignment(rank.path, {names.ROUND: "0"})  # this round's own assignment is no reason to stop waiting
    began = time.monotonic()
    assert rank._await_own_stop(True, False) == (True, False)
    assert time.monotonic() - began < 0.1
    assert rank._await_own_stop(False, False) == (False, False)
    assert 0.3 <= time.monotonic() - began < STOP_GRACE_S
