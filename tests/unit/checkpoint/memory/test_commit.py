"""Which gathered reply of a per-node snapshot commit reports the failure."""

from __future__ import annotations

from elasticrun.checkpoint.memory.commit import first_error


def test_no_error_is_none() -> None:
    assert first_error([{"ok": True}, {}, {"files": []}]) is None


def test_lowest_failing_rank_wins() -> None:
    replies = [{"ok": True}, {"error": "disk full"}, {"error": "later"}]
    assert first_error(replies) == (1, "disk full")


def test_empty_gather_is_none() -> None:
    assert first_error([]) is None
