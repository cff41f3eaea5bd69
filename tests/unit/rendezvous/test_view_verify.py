"""JobView.verify: a view that missed a change in etcd (a watch ended without a word) reads the job again;
one that is current, or whose events are only in flight, does not."""

from __future__ import annotations

import threading
from typing import Iterator

import pytest

from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.view import JobView

from helpers.fake_store import FakeStore

KEYS = JobKeys("verify")


@pytest.fixture
def view(store: FakeStore) -> Iterator[JobView]:  # store: the in-memory one of tests/conftest.py
    store.put(KEYS.leader, "a")
    v = JobView(store, KEYS, nodes=False)
    yield v
    v.close()


def test_a_current_view_is_left_alone(view: JobView) -> None:
    assert view.verify([KEYS.leader, KEYS.topology]) is False
    assert view.get(KEYS.leader).value == b"a"


def test_a_view_whose_watch_went_silent_reads_the_job_again(store: FakeStore, view: JobView) -> None:
    view._stop_watches()  # silent from now on: no event, no error
    store.delete(KEYS.leader)
    store.put(KEYS.topology, "{}")
    assert view.get(KEYS.leader) is not None, "the silent view still shows the old leader"
    assert view.verify([KEYS.leader, KEYS.topology], settle=0.2) is True
    assert view.get(KEYS.leader) is None and view.get(KEYS.topology) is not None
    store.put(KEYS.leader, "b")  # and it watches again
    version = view.version
    while view.get(KEYS.leader) is None:
        assert view.wait_change(version, 5.0) != version, "the view's new watch delivers"
        version = view.version
    assert view.get(KEYS.leader).value == b"b"


def test_events_in_flight_are_waited_for_not_read_again(store: FakeStore, view: JobView) -> None:
    reads = []
    real_sync = view._sync
    view._sync = lambda: (reads.append(1), real_sync())  # type: ignore[method-assign]
    held = threading.Event()
    original = view._on_events

    def late(events, gen) -> None:  # noqa: ANN001 - the view's callback
        held.wait(5)  # the event reaches the view only after verify read etcd
        original(events, gen)

    view._on_events = late  # type: ignore[method-assign]
    store.put(KEYS.leader, "b")
    threading.Timer(0.1, held.set).start()
    assert view.verify([KEYS.leader], settle=3.0) is False, "the view caught up: no second read"
    assert view.get(KEYS.leader).value == b"b" and reads == []
