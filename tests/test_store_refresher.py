"""The keep-alive thread shared by the leases of one client (``store/refresher.py``), on a fake store."""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Sequence

from elasticrun.errors import StoreError
from elasticrun.store.refresher import refresher_for


class FakeStore:
    """Answers every keep-alive with a TTL and records which lease ids each batch held."""

    def __init__(self) -> None:
        self.batches: List[List[int]] = []
        self.lock = threading.Lock()

    def refresh_leases(self, ids: Sequence[int], timeout: float = 1.0) -> Dict[int, int]:
        with self.lock:
            self.batches.append(list(ids))
        return {i: 10 for i in ids}

    def sent(self, lease_id: int) -> int:
        with self.lock:
            return sum(batch.count(lease_id) for batch in self.batches)


class FakeLease:
    """What the refresher needs of a lease (``Refreshable``), recording its answers."""

    def __init__(self, lease_id: int, interval: float, first_due: float) -> None:
        self.lease_id = lease_id
        self._next_due = first_due
        self.looked_at = 0  # reads of next_due: what a refresher turn costs
        self._interval = interval
        self.stopped = False
        self.answers: List[float] = []
        self._refresher = None

    @property
    def next_due(self) -> float:
        self.looked_at += 1
        return self._next_due

    @next_due.setter
    def next_due(self, value: float) -> None:
        self._next_due = value

    @property
    def interval(self) -> float:
        return self._interval

    @property
    def refresh_timeout(self) -> float:
        return 1.0

    def start_refresh(self, sent: float) -> bool:
        if self.stopped:
            self._refresher.remove(self)  # type: ignore[union-attr]
            return False
        return True

    def refreshed(self, sent: float, remaining: int) -> None:
        self.answers.append(sent)

    def refresh_failed(self, sent: float, err: StoreError) -> None:  # pragma: no cover - the fake always answers
        raise AssertionError(f"unexpected failure: {err}")


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_every_lease_is_refreshed_in_its_turn_and_a_removed_one_no_more() -> None:
    store = FakeStore()
    now = time.monotonic()
    # 300 leases whose first keep-alives are spread over 0.4 s: they go in several batches, each lease
    # in its own turn, and keep their phase.
    leases = [FakeLease(i, interval=0.4, first_due=now + 0.4 * i / 300) for i in range(300)]
    refresher = None
    for lease in leases:
        refresher = lease._refresher = refresher_for(store, lease)  # type: ignore[assignment]
    assert refresher is not None and all(lease._refresher is refresher for lease in leases), "one thread per store"

    wait_until(lambda: all(len(lease.answers) >= 3 for lease in leases), 10, "three keep-alives of every lease")
    assert len(store.batches) > 3, "leases due at different times go in different batches"
    # A turn looks at the leases it sends, not at every lease of the process (300 leases, several
    # batches per interval: a scan per turn would read each lease's due time once per batch).
    sent = sum(len(b) for b in store.batches)
    looked = sum(lease.looked_at for lease in leases)
    assert looked <= 3 * sent + 2 * len(leases), f"{looked} looks at due times for {sent} keep-alives"
    for lease in leases[:20]:
        gaps = [b - a for a, b in zip(lease.answers, lease.answers[1:])]
        assert all(g >= 0.4 / 2 - 0.05 for g in gaps), f"lease {lease.lease_id} refreshed too often: {gaps}"

    # A stopped lease leaves at its next turn and is never sent again; the others go on.
    stopped = leases[7]
    stopped.stopped = True
    wait_until(lambda: len(leases[8].answers) >= 6, 10, "more keep-alives of the others")
    count = store.sent(stopped.lease_id)
    wait_until(lambda: len(leases[8].answers) >= 9, 10, "more keep-alives of the others")
    assert store.sent(stopped.lease_id) == count, "a stopped lease was refreshed again"

    # The thread ends with its last lease; a new lease then gets a new thread.
    for lease in leases:
        refresher.remove(lease)  # type: ignore[union-attr]
    wait_until(lambda: not refresher._thread.is_alive(), 5, "the refresher thread to end")  # type: ignore[union-attr]
    late = FakeLease(999, interval=0.4, first_due=time.monotonic())
    late._refresher = refresher_for(store, late)  # type: ignore[assignment]
    assert late._refresher is not refresher
    wait_until(lambda: len(late.answers) >= 1, 5, "the new lease's keep-alive")
    late._refresher.remove(late)  # type: ignore[attr-defined]
