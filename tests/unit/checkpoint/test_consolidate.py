"""What a consolidated export writes, decided from tensor names and sizes (no checkpoint, no files)."""

from __future__ import annotations

import json
import os

import pytest

from elasticrun.checkpoint.consolidate import plan_export, select_tensors
from elasticrun.errors import CheckpointError


def test_only_keeps_a_prefix_and_strip_prefix_removes_it() -> None:
    tensors = ["model.a", "model.b", "optim.m"]
    assert select_tensors(tensors, "c", "model.", False) == (["model.a", "model.b"], ["model.a", "model.b"])
    assert select_tensors(tensors, "c", "model.", True) == (["model.a", "model.b"], ["a", "b"])
    assert select_tensors(tensors, "c", None, True) == (tensors, tensors)


def test_nothing_kept_or_an_empty_key_is_refused() -> None:
    with pytest.raises(CheckpointError, match="has no tensor starting with 'x'"):
        select_tensors(["a"], "c", "x", False)
    with pytest.raises(CheckpointError, match="leaves an empty tensor name"):
        select_tensors(["model", "model.a"], "c", "model", True)


def test_a_safetensors_name_is_one_file_without_an_index() -> None:
    layout = plan_export("out.safetensors", [("a", "m.a")], {"m.a": 10}, None)
    assert (layout.files, layout.index, layout.directory) == ([("out.safetensors", [("a", "m.a")])], None, False)


def test_shards_in_a_directory_with_an_index_when_several() -> None:
    items = [("a", "m.a"), ("b", "m.b"), ("c", "m.c")]
    layout = plan_export("out", items, {"m.a": 60, "m.b": 60, "m.c": 30}, 100)
    assert layout.directory
    assert layout.files == [(os.path.join("out", "model-00001-of-00002.safetensors"), [("a", "m.a")]),
                            (os.path.join("out", "model-00002-of-00002.safetensors"), [("b", "m.b"), ("c", "m.c")])]
    index = json.loads(layout.index or "")
    assert index["metadata"]["total_size"] == 150
    assert index["weight_map"] == {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                                   "c": "model-00002-of-00002.safetensors"}


def test_one_shard_in_a_directory_has_no_index() -> None:
    layout = plan_export("out", [("a", "m.a")], {"m.a": 10}, None)
    assert layout.files == [(os.path.join("out", "model.safetensors"), [("a", "m.a")])] and layout.index is None


def test_a_shard_size_with_a_safetensors_name_is_refused() -> None:
    with pytest.raises(CheckpointError, match="--max-shard-size writes a directory"):
        plan_export("out.safetensors", [("a", "m.a")], {"m.a": 10}, 100)
