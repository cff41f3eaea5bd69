"""Rank 0's checks before committing a generation persisted by several nodes (no files, no processes)."""

from __future__ import annotations

from elasticrun.checkpoint.checksum import Checksum
from elasticrun.checkpoint.format import FileEntry
from elasticrun.checkpoint.memory.persist import first_node_error, missing_files


def _entry(name: str, size: int) -> FileEntry:
    return FileEntry(name=name, rank=0, size=size, digest="0", algo=Checksum.CRC32)


def test_first_node_error_is_the_first_reported() -> None:
    assert first_node_error([(None, []), ("node 1: disk full", []), ("node 2: gone", [])]) == "node 1: disk full"
    assert first_node_error([(None, []), (None, [])]) is None


def test_missing_files_are_absent_or_of_another_size_in_name_order() -> None:
    files = {"b": _entry("b", 10), "a": _entry("a", 5), "c": _entry("c", 0), "d": _entry("d", 7)}
    assert missing_files(files, {"a": 5, "b": None, "c": 0, "d": 6}) == ["b", "d"]
    assert missing_files(files, {"a": 5, "b": 10, "c": 0, "d": 7}) == []
