"""The recovery word an agent leaves its kept workers (``<file>.recover``): how long to wait, and whether
the round's collectives broke (NCCL workers abort theirs on it)."""

from __future__ import annotations

from pathlib import Path

from elasticrun.job.inplace import announce_recovery, clear, collectives_broken, recovery_announced


def test_a_planned_change_announces_a_wait_but_no_break(tmp_path: Path) -> None:
    f = str(tmp_path / "w0")
    announce_recovery(f, 3, 90.0)
    assert recovery_announced(f, 3) == 90.0
    assert not collectives_broken(f, 3)


def test_a_crash_announces_a_break_for_its_round_only(tmp_path: Path) -> None:
    f = str(tmp_path / "w0")
    assert not collectives_broken(f, 3), "no word yet"
    announce_recovery(f, 3, 90.0, broken=True)
    assert collectives_broken(f, 3)
    assert not collectives_broken(f, 4) and not collectives_broken(f, 2), "another round's word"
    clear(f)
    assert not collectives_broken(f, 3), "a fresh worker starts without a word"


def test_a_malformed_word_is_no_break(tmp_path: Path) -> None:
    f = tmp_path / "w0"
    for body in ("", "{", "[]", '{"round": "x", "broken": true}', '{"round": 3, "broken": "yes"}', '{"broken": true}'):
        (tmp_path / "w0.recover").write_text(body)
        assert not collectives_broken(str(f), 3), body
