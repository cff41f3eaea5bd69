"""``status --watch``'s health of its reads (elasticrun.cli.status.ReadHealth): no etcd, no clock."""

from __future__ import annotations

from elasticrun.cli.status import ReadHealth


def test_a_good_read_with_a_live_watch_is_healthy() -> None:
    failing = ReadHealth(error="etcd down", told="etcd down", failing_since=10.0)
    assert failing.after_read(fresh=True, watching=True, error="", attempt=20.0) == ReadHealth()


def test_failing_since_the_first_failed_read_until_both_work_again() -> None:
    h = ReadHealth().after_read(fresh=False, watching=True, error="connection refused", attempt=10.0)
    assert h == ReadHealth("connection refused", "", 10.0)
    h = h.after_read(fresh=False, watching=False, error="timed out", attempt=12.0)
    assert h == ReadHealth("timed out", "", 10.0), "the first failure's time is kept"
    h = h.after_read(fresh=True, watching=False, error="no watch", attempt=13.0)
    assert h.failing_since == 10.0 and h.error == "no watch", "a read without a watch is not healthy yet"


def test_an_error_is_told_once_until_it_changes() -> None:
    h = ReadHealth("connection refused", "", 10.0)
    assert h.to_tell() == "connection refused"
    told = ReadHealth("connection refused", "connection refused", 10.0)
    assert told.to_tell() is None
    assert told.after_read(False, True, "timed out", 11.0).to_tell() == "timed out"
    assert ReadHealth().to_tell() is None


def test_the_watch_gives_up_after_the_timeout_of_failures_in_a_row() -> None:
    h = ReadHealth("connection refused", "connection refused", 10.0)
    assert h.gave_up(14.9, 5.0) is None
    assert h.gave_up(15.0, 5.0) == "connection refused (gave up after 5s: --timeout)"
    assert h.gave_up(1e9, None) is None, "no --timeout: never"
    assert ReadHealth().gave_up(1e9, 5.0) is None, "healthy"
    assert ReadHealth("", "", 0.0).gave_up(5.0, 5.0) == "etcd does not answer (gave up after 5s: --timeout)"
