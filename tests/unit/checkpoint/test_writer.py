"""The checks and decisions of save()'s prepare step, without a process group or files."""

from __future__ import annotations

import math

import pytest
import torch

from elasticrun.checkpoint.format import Replicate, Shard
from elasticrun.checkpoint.writer import check_json, check_save_args, default_name, first_error, local_infos
from elasticrun.errors import CheckpointError


@pytest.mark.parametrize("keep_last, io_threads, says", [
    (0, None, "keep_last must be a positive integer (got 0)"),
    (2.0, None, "keep_last must be a positive integer (got 2.0)"),
    (None, 0, "io_threads must be a positive integer (got 0)"),
    (None, "4", "io_threads must be a positive integer (got '4')"),
])
def test_bad_arguments_are_refused(keep_last, io_threads, says):
    with pytest.raises(CheckpointError) as err:
        check_save_args(keep_last, io_threads)
    assert str(err.value) == says


def test_good_arguments_pass():
    check_save_args(None, None)
    check_save_args(3, 1)


def test_local_infos_name_dtype_shape_and_placement():
    tensors = {"w": torch.zeros(4, 2), "b": torch.zeros(3, dtype=torch.bfloat16)}
    assert local_infos(tensors, {"w": Shard(0)}) == [("w", "F32", (4, 2), Shard(0)), ("b", "BF16", (3,), Replicate())]


def test_placements_must_name_tensors_and_be_placements():
    with pytest.raises(CheckpointError, match="placements names 'x', which is not a tensor in the state dict"):
        local_infos({"w": torch.zeros(1)}, {"x": Shard(0)})
    with pytest.raises(CheckpointError, match=r"placement of 'w' must be Shard\(dim\) or Replicate\(\), got 0"):
        local_infos({"w": torch.zeros(1)}, {"w": 0})  # type: ignore[dict-item]


def test_metadata_must_be_json():
    check_json({"step": 1, "loss": math.nan}, {"note": "x"}, {"w": {"__tensor__": "w"}})
    with pytest.raises(CheckpointError, match="training_state/user_metadata must be JSON-serialisable"):
        check_json(None, {"when": object()}, None)


def test_the_first_failing_rank_is_named_when_there_are_several():
    ok = {"error": None}
    assert first_error([ok, ok]) is None
    assert first_error([{"error": "disk full"}]) == "disk full"
    assert first_error([ok, {"error": "a"}, {"error": "b"}]) == "rank 1: a"


def test_default_names():
    assert default_name({"step": 1200}, 0.0) == "step-00001200"
    assert default_name({"step": "12"}, 1.5) == "ckpt-19700101-000001-500"
    assert default_name(None, 86400.25) == "ckpt-19700102-000000-250"
