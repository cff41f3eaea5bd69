"""The save plan: who writes which bytes, and how a rank's bytes are cut into parallel files.

Pure planning (no I/O): every tensor's chunks must tile it exactly once, file keys must be
unique, and a rank with several threads must get files of about equal size."""

from __future__ import annotations

import random

import pytest
import torch

import elasticrun.checkpoint.plan as plan_mod
from elasticrun.checkpoint.format import DTYPES, Replicate, Shard
from elasticrun.checkpoint.plan import make_plan


def _coverage(entry) -> torch.Tensor:
    """How many chunks cover each element of the tensor."""
    hits = torch.zeros(entry.shape, dtype=torch.int32)
    for c in entry.chunks:
        hits[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.shape))] += 1
    return hits


def _random_infos(rng: random.Random, world: int):
    names = [f"t{i}" for i in range(rng.randint(1, 8))]
    per_rank = [[] for _ in range(world)]
    for name in names:
        dtype = rng.choice(["F32", "BF16", "U8", "I64"])
        ndim = rng.randint(0, 3)
        shape = [rng.randint(0, 40) for _ in range(ndim)]
        if ndim and rng.random() < 0.5:
            dim = rng.randrange(ndim)
            for r in range(world):
                local = list(shape)
                local[dim] = rng.randint(0, 9)
                per_rank[r].append((name, dtype, tuple(local), Shard(dim)))
        else:
            for r in range(world):
                per_rank[r].append((name, dtype, tuple(shape), Replicate()))
    return per_rank


@pytest.mark.parametrize("seed", range(40))
def test_chunks_tile_every_tensor_exactly_once_with_any_thread_counts(seed, monkeypatch):
    rng = random.Random(seed)
    monkeypatch.setattr(plan_mod, "MIN_PART_BYTES", rng.choice([1, 64, 1000]))
    monkeypatch.setattr(plan_mod, "SPLIT_BYTES", rng.choice([1, 4 << 20]))
    world = rng.randint(1, 4)
    threads = [rng.randint(1, 4) for _ in range(world)]
    plan = make_plan(_random_infos(rng, world), threads)
    for entry in plan.tensors.values():
        assert bool((_coverage(entry) == 1).all()), f"{entry.name}: chunks overlap or leave gaps"
    for rank in range(world):
        files = plan.files_of(rank)
        assert len(files) <= threads[rank]
        for fname, items in files:
            assert fname.startswith(f"shard-{rank:05d}-of-{world:05d}")
            keys = [i.chunk.key for i in items]
            assert len(keys) == len(set(keys)), f"{fname} would hold a key twice: {keys}"
        # a chunk's rows map back to the same rows of the rank's local tensor
        for item in plan.writes[rank]:
            if item.rows is not None:
                assert item.rows[1] - item.rows[0] == item.chunk.shape[0]


def test_a_rank_with_four_threads_writes_four_files_of_about_equal_size(monkeypatch):
    monkeypatch.setattr(plan_mod, "MIN_PART_BYTES", 1 << 10)
    infos = [[("big", "F32", (1000, 64), Replicate()), ("small", "F32", (3,), Replicate()),
              ("scalar", "I64", (), Replicate())]]
    plan = make_plan(infos, [4])
    files = plan.files_of(0)
    assert [f for f, _ in files] == [f"shard-00000-of-00001-part-{p}-of-4.safetensors" for p in range(4)]
    sizes = [sum(plan.item_bytes(i) for i in items) for _, items in files]
    assert max(sizes) - min(sizes) <= 64 * 4 + 8, sizes  # within a row plus the unsplittable scalar
    assert sum(sizes) == 1000 * 64 * 4 + 3 * 4 + 8


def test_small_ranks_and_single_threads_keep_one_file_per_rank():
    infos = [[("w", "F32", (10, 10), Replicate())] for _ in range(2)]
    for threads in (None, [1, 1], [4, 4]):  # 400 bytes is far below MIN_PART_BYTES
        plan = make_plan(infos, threads)
        files = [f for r in range(2) for f, _ in plan.files_of(r)]
        assert files == ["shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
        assert [len(items) for _, items in plan.files_of(1)] == [0]  # the whole tensor went to rank 0
    assert DTYPES["F32"][1] * 100 < plan_mod.MIN_PART_BYTES


def test_tensors_stay_whole_when_that_balances_so_loads_can_map_them():
    mib16 = (1024, 4096)  # float32: 16 MiB
    infos = [[(f"layer{i:02d}", "F32", mib16, Replicate()) for i in range(16)] for _ in range(2)]
    plan = make_plan(infos, [2, 2])
    assert all(len(t.chunks) == 1 for t in plan.tensors.values())  # no tensor split
    assert plan.bytes_per_rank() == [8 << 24, 8 << 24]
    assert [len(plan.files_of(r)) for r in range(2)] == [2, 2]  # 128 MiB per rank: two files in parallel
    # One huge tensor can only be balanced by splitting it: rows across ranks, then across files.
    plan = make_plan([[("emb", "F32", (1 << 16, 1024), Replicate())]] * 2, [2, 2])
    assert len(plan.tensors["emb"].chunks) == 4 and plan.bytes_per_rank() == [1 << 27, 1 << 27]
