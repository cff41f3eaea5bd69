"""The load plan from metadata alone: which region of each tensor a rank gets, which saved chunk is
exactly that region, which files it hashes, and the order it visits the files (no files read)."""

from __future__ import annotations

import pytest

from elasticrun.checkpoint.checksum import Checksum
from elasticrun.checkpoint.format import CheckpointMeta, Chunk, FileEntry, Replicate, Shard, TensorEntry
from elasticrun.checkpoint.reader import exact_chunk, file_order, hash_share, plan_regions
from elasticrun.errors import CheckpointError

FILES = [f"shard-{r:05d}-of-00004.safetensors" for r in range(4)]


def meta() -> CheckpointMeta:
    # "w": 10 rows saved as two row blocks (0-5 by rank 0, 5-10 by rank 1); "b": replicated, one chunk.
    w = TensorEntry("w", "F32", (10, 3), Shard(0), (Chunk(FILES[0], "w.0", (0, 0), (5, 3)),
                                                    Chunk(FILES[1], "w.1", (5, 0), (5, 3))))
    b = TensorEntry("b", "F32", (3,), Replicate(), (Chunk(FILES[2], "b", (0,), (3,)),))
    files = {f: FileEntry(f, r, 100, "0" * 8, Checksum.CRC32) for r, f in enumerate(FILES)}
    return CheckpointMeta("step-1", 2, 0.0, {"w": w, "b": b}, files, None)


def test_a_shard_splits_like_tensor_split_and_a_replicated_tensor_is_whole():
    m = meta()
    assert [plan_regions(m, ["w"], {}, r, 3)["w"] for r in range(3)] == [([0, 0], [4, 3]), ([4, 0], [3, 3]),
                                                                         ([7, 0], [3, 3])]
    assert plan_regions(m, ["b"], {}, 2, 3) == {"b": ([0], [3])}
    assert plan_regions(m, ["w", "b"], {}, 0, 1) == {"w": ([0, 0], [10, 3]), "b": ([0], [3])}


def test_placements_override_the_saved_ones():
    m = meta()
    assert plan_regions(m, ["w"], {"w": Replicate()}, 1, 2)["w"] == ([0, 0], [10, 3])
    assert plan_regions(m, ["w"], {"w": Shard(1)}, 1, 3)["w"] == ([0, 1], [10, 1])
    with pytest.raises(CheckpointError, match="cannot shard 'b' along dim 1: it has 1 dims"):
        plan_regions(m, ["b"], {"b": Shard(1)}, 0, 2)


def test_the_exact_chunk_only_when_a_region_is_one_saved_chunk():
    m = meta()
    w = m.tensors["w"]
    assert exact_chunk(w, plan_regions(m, ["w"], {}, 1, 2)["w"]) == w.chunks[1]
    assert exact_chunk(w, plan_regions(m, ["w"], {}, 0, 1)["w"]) is None  # two chunks make it
    assert exact_chunk(w, plan_regions(m, ["w"], {}, 0, 3)["w"]) is None  # part of a chunk
    assert exact_chunk(m.tensors["b"], ([0], [3])) == m.tensors["b"].chunks[0]


def test_each_rank_starts_at_its_own_share_of_the_files():
    every = set(FILES)
    assert file_order(FILES, 0, 2, every) == FILES
    assert file_order(FILES, 1, 2, every) == FILES[2:] + FILES[:2]
    assert file_order(list(reversed(FILES)), 3, 4, {FILES[0], FILES[2]}) == [FILES[0], FILES[2]]
    assert file_order(FILES, 1, 4, {FILES[0], FILES[2]}) == [FILES[2], FILES[0]]
    assert file_order(FILES, 0, 1, set()) == []


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8])
def test_every_file_is_hashed_by_exactly_one_rank(world):
    shares = [hash_share(FILES, r, world) for r in range(world)]
    assert sorted(f for s in shares for f in s) == sorted(FILES)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
