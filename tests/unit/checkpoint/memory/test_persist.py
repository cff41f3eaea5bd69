"""Persisting a generation of several nodes: rank 0's checks before the commit, and a node's stage (no processes)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

from elasticrun.checkpoint.checksum import Checksum
from elasticrun.checkpoint.format import FileEntry
from elasticrun.checkpoint.memory.persist import _copy_node_part, first_node_error, missing_files
from elasticrun.job.shm import ShmLayout


def _entry(name: str, size: int) -> FileEntry:
    return FileEntry(name=name, rank=0, size=size, digest="0", algo=Checksum.CRC32)


def test_first_node_error_is_the_first_reported() -> None:
    assert first_node_error([(None, []), ("node 1: disk full", []), ("node 2: gone", [])]) == "node 1: disk full"
    assert first_node_error([(None, []), (None, [])]) is None


def test_missing_files_are_absent_or_of_another_size_in_name_order() -> None:
    files = {"b": _entry("b", 10), "a": _entry("a", 5), "c": _entry("c", 0), "d": _entry("d", 7)}
    assert missing_files(files, {"a": 5, "b": None, "c": 0, "d": 6}) == ["b", "d"]
    assert missing_files(files, {"a": 5, "b": 10, "c": 0, "d": 7}) == []


def test_a_rank_that_does_not_lead_its_node_leaves_the_leaders_stage_alone(tmp_path: Path) -> None:
    """The node's leader copies its files from ``persist/<name>`` (hard links); the node's other ranks make the
    same call and copy nothing. One of them that came late removed the stage under the leader's copy (a
    generation not persisted, seen under load)."""
    base, name = str(tmp_path / "node"), "snap-00000003-1"
    stage = os.path.join(ShmLayout(base).persist, name)
    os.makedirs(stage)
    open(os.path.join(stage, "shard-00000-of-00002.safetensors"), "wb").close()  # the leader is copying it
    part = _copy_node_part(base, name, SimpleNamespace(leader=False, me=0), str(tmp_path / "disk"))
    assert part.error is None and part.copied == []
    assert os.listdir(stage) == ["shard-00000-of-00002.safetensors"], "the leader's stage is intact"
