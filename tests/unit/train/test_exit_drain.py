"""The exit drain of train/dist.py: other threads get the GIL and finish before the interpreter finalizes.

Real threads of this process and its real ``/proc/self/task``; a fake task directory for the parsing."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from elasticrun.train.dist import _let_threads_finish, _runnable_threads


def _task(tasks: Path, tid: int, comm: str, state: str) -> None:
    (tasks / str(tid)).mkdir()
    (tasks / str(tid) / "stat").write_text(f"{tid} ({comm}) {state} 1 1 1 0 -1 4194560 0 0 0\n")


def test_runnable_threads_counts_state_r_after_a_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    _task(tmp_path, 11, "pt_main_thread", "S")
    _task(tmp_path, 12, "gloo) R (x", "S")  # a name that looks like a state
    _task(tmp_path, 13, "worker 1", "R")
    _task(tmp_path, 14, "etcd watch", "R")
    assert _runnable_threads(str(tmp_path)) == 2
    (tmp_path / "15").mkdir()  # a thread that ended between listing and reading
    assert _runnable_threads(str(tmp_path)) == 2
    assert _runnable_threads(str(tmp_path / "absent")) == 0


def test_the_drain_waits_for_a_thread_that_needs_the_gil_and_not_longer() -> None:
    done = threading.Event()

    def busy() -> None:  # Python work: runs only while the caller hands the GIL over
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            sum(range(1000))
        done.set()

    thread = threading.Thread(target=busy)
    thread.start()
    waited = _let_threads_finish(10.0)
    assert done.is_set(), f"returned after {waited:.3f} s while the thread still ran"
    assert waited < 5.0
    thread.join()
    assert _let_threads_finish(10.0) < 1.0, "nothing else runs: it returns at once"


def test_the_drain_gives_up_at_its_limit_when_a_thread_never_rests() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        waited = _let_threads_finish(0.3)
        assert 0.3 <= waited < 3.0, waited
    finally:
        stop.set()
        thread.join()
