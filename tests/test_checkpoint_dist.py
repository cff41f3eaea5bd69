"""Under real gloo process groups: 4 ranks save (uneven Shard slices + replicated tensors split
across ranks), then the same processes load through real subgroups of 4, 3, 2 and 1 ranks and
get bit-identical tensors; async saves with retention run beside training collectives."""

from __future__ import annotations

import pytest

from helpers.ckpt import run_group

pytestmark = pytest.mark.integration  # starts etcd or processes


def _check(results):
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} exited {res.returncode}:\n{res.stdout[-4000:]}"


def test_save_4_load_4_3_2_1(tmp_path):
    _check(run_group("reshard", 4, tmp_path / "root", tmp_path))


def test_ranks_writing_several_files_each_load_at_4_3_2_1(tmp_path):
    _check(run_group("reshard_parts", 4, tmp_path / "root", tmp_path))


def test_async_saves_with_retention_under_gloo(tmp_path):
    _check(run_group("async", 2, tmp_path / "root", tmp_path))
