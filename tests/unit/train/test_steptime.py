"""StepTimer on a made-up clock: compute time ends at the last mark, parts add up, the mean forgets old steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticrun.job import env as env_names
from elasticrun.train import steptime
from elasticrun.train.steptime import StepTimer


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_compute_ends_at_the_last_mark_not_at_the_end_of_the_step():
    c = Clock()
    t = StepTimer(clock=c, rank=0)
    t.begin()
    c.t += 0.1
    t.computed()
    c.t += 0.2
    t.computed()  # the last bucket
    c.t += 5.0  # waiting in the all-reduce for a slow peer
    assert t.end() == pytest.approx(0.3)


def test_compute_blocks_add_up_and_win_over_marks():
    c = Clock()
    t = StepTimer(clock=c, rank=0)
    t.begin()
    for _ in range(3):
        with t.compute():
            c.t += 0.1
        t.computed()
        c.t += 1.0
    assert t.end() == pytest.approx(0.3)


def test_a_step_without_marks_is_all_compute_and_end_without_begin_is_none():
    c = Clock()
    t = StepTimer(clock=c, rank=0)
    assert t.end() is None
    with t.step():
        c.t += 0.25
    assert t.mean() == pytest.approx(0.25)


def test_the_mean_covers_the_last_window_only():
    c = Clock()
    t = StepTimer(clock=c, rank=0)
    for seconds in (1.0, 1.0):
        with t.step():
            c.t += seconds
    c.t += steptime.WINDOW_S + 1
    with t.step():
        c.t += 0.1
    assert t.mean() == pytest.approx(0.1)
    c.t += steptime.WINDOW_S + 1
    assert t.mean() is None


def test_each_rank_writes_its_figure_and_the_node_reads_this_round_only(tmp_path: Path, monkeypatch):
    monkeypatch.setenv(env_names.STEP_TIMES_DIR, str(tmp_path))
    monkeypatch.setenv(env_names.ROUND, "3")
    c = Clock()
    for rank, seconds in ((4, 0.5), (5, 0.25)):
        t = StepTimer(clock=c, rank=rank)
        with t.step():
            c.t += seconds
    (tmp_path / "9").write_text("2 9 7.0\n")  # an earlier round's worker
    (tmp_path / "junk").write_text("not a figure")
    assert steptime.node_step_times(3) == {4: pytest.approx(0.5), 5: pytest.approx(0.25)}
    assert steptime.node_step_times(2) == {9: 7.0}
