"""A memory restore never loads bytes that changed in shared memory after the commit: every byte
is hashed as it is copied; a bad copy is replaced by the peer's replica, else the restore falls
back to the next checkpoint (disk). Real files, real gloo processes for the two-node case."""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import List, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticrun.checkpoint import Snapshotter, list_checkpoints, save
from elasticrun.checkpoint.format import CheckpointMeta
from elasticrun.checkpoint.shardfile import read_header
from elasticrun.job.shm import GENERATIONS
from elasticrun.train import load_latest

from helpers.ckpt import node_results, run_nodes

NAN = struct.pack("<f", float("nan"))


def _spoil(shard: Path) -> None:
    """Overwrite the last float of a shard file's data in place with a NaN (same size: only the
    checksum can tell), as a stray write into /dev/shm would."""
    with open(shard, "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(NAN)


def _shards(gen: Path) -> list:
    return sorted(p for p in gen.iterdir() if p.name.endswith(".safetensors"))


def test_a_changed_local_generation_is_not_loaded_and_disk_is_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    base, disk = tmp_path / "shm", str(tmp_path / "disk")
    base.mkdir()
    monkeypatch.setenv("ELASTICRUN_SNAPSHOT_DIR", str(base))
    save({"w": torch.full((256,), 1.0)}, disk, training_state={"step": 1})
    Snapshotter().snapshot({"w": torch.full((256,), 2.0)}, training_state={"step": 2})
    gen = next(i for i in list_checkpoints(str(base / GENERATIONS)) if i.status == "complete")
    shard = _shards(base / GENERATIONS / gen.name)[0]
    _spoil(shard)
    target = {"w": torch.zeros(256)}
    with caplog.at_level(logging.WARNING, logger="elasticrun"):
        ckpt = load_latest(disk, state_dict=target)
    assert (ckpt.tier, ckpt.training_state.step) == ("disk", 1), "the changed memory generation was loaded"
    assert torch.equal(target["w"], torch.full((256,), 1.0)) and not torch.isnan(target["w"]).any()
    # One clear line names the file that failed and why, another the fallback.
    lines = [r.getMessage() for r in caplog.records]
    assert any(shard.name in ln and "fails its checksum" in ln and "changed in shared memory" in ln
               for ln in lines), lines
    assert any(gen.name in ln and "trying the previous one" in ln for ln in lines), lines
    # No later restore tries it again.
    assert load_latest(disk).tier == "disk"


WORKER = r"""
import json, os, sys
import torch, torch.distributed as dist
from elasticrun.checkpoint import Shard, Snapshotter, save
from elasticrun.train import load_latest

phase, disk = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
pl = {"w": Shard(0)}
full = torch.arange(64, dtype=torch.float32).reshape(32, 2)
if phase == "save":
    save({"w": torch.tensor_split(-full, world)[rank].clone()}, disk, training_state={"step": 1}, placements=pl)
    snaps = Snapshotter()
    snaps.snapshot({"w": torch.tensor_split(full, world)[rank].clone()}, training_state={"step": 5}, placements=pl)
    snaps.wait()
    dist.barrier()
else:
    target = {"w": torch.zeros_like(torch.tensor_split(full, world)[rank])}
    ck = load_latest(disk, state_dict=target, placements=pl)
    want = full if ck.tier == "memory" else -full
    ok = torch.equal(target["w"], torch.tensor_split(want, world)[rank])
    print("RESULT " + json.dumps({"rank": rank, "tier": ck.tier, "step": ck.training_state.step, "ok": ok}), flush=True)
    dist.barrier()
dist.destroy_process_group()
"""


def _saved_on_two_nodes(tmp_path: Path) -> Tuple[Path, Path, Path, Path, List[Path]]:
    """Two nodes save a memory generation (and the disk checkpoint ``disk``): (disk, node 0's and node 1's
    shm dirs, node 0's generation, node 0's own part files in it)."""
    disk, n0, n1 = tmp_path / "disk", tmp_path / "node0", tmp_path / "node1"
    for d in (n0, n1):
        d.mkdir()
    saved = run_nodes(WORKER, ["save", str(disk)], [n0, n1])
    assert all(o.returncode == 0 for o in saved), [o.stdout[-2000:] for o in saved]
    (gen,) = [p for p in (n0 / GENERATIONS).iterdir() if (p / "metadata.json").exists()]
    meta = CheckpointMeta.loads((gen / "metadata.json").read_bytes(), str(gen))
    return disk, n0, n1, gen, [gen / n for n, e in meta.files.items() if e.rank == 0]


@pytest.mark.integration
def test_a_changed_part_is_fetched_from_the_replica_on_the_next_node(tmp_path: Path) -> None:
    disk, n0, n1, gen, mine = _saved_on_two_nodes(tmp_path)
    assert mine and (n1 / "replicas" / gen.name / mine[0].name).exists(), "node 1 holds node 0's replica"
    _spoil(mine[0])
    outs = run_nodes(WORKER, ["load", str(disk)], [n0, n1])
    res = node_results(outs)
    # Both ranks restored the memory step with the right values: node 0's part came from node 1's replica.
    assert all((r["tier"], r["step"], r["ok"]) == ("memory", 5, True) for r in res), res
    assert "fails its checksum" in outs[0].stdout, outs[0].stdout[-3000:]


@pytest.mark.integration
def test_a_changed_part_whose_replica_changed_too_falls_back_to_disk_on_every_rank(tmp_path: Path) -> None:
    """No good copy left anywhere: the replica fetched from node 1 fails its check on receipt, the
    restore fails on both ranks alike with a line naming the file, and both load the disk checkpoint."""
    disk, n0, n1, gen, mine = _saved_on_two_nodes(tmp_path)
    replica = n1 / "replicas" / gen.name / mine[0].name
    assert mine and replica.exists(), "node 1 holds node 0's replica"
    _spoil(mine[0])
    _spoil(replica)
    outs = run_nodes(WORKER, ["load", str(disk)], [n0, n1])
    res = node_results(outs)
    assert all((r["tier"], r["step"], r["ok"]) == ("disk", 1, True) for r in res), res
    said = outs[0].stdout
    assert f"{mine[0].name} on this node fails its checksum" in said, said[-3000:]
    assert f"checkpoint {gen.name} cannot be loaded" in said and "trying the previous one" in said, said[-3000:]


def test_bytes_changed_after_a_check_would_have_run_are_still_caught(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is of the bytes copied, not of the file before the copy: a change that lands after
    the files were fetched and before they are read is caught too (a check ahead of the copy missed it)."""
    from elasticrun.checkpoint import reader

    base, disk = tmp_path / "shm", str(tmp_path / "disk")
    base.mkdir()
    monkeypatch.setenv("ELASTICRUN_SNAPSHOT_DIR", str(base))
    save({"w": torch.full((256,), 1.0)}, disk, training_state={"step": 1})
    name = Snapshotter().snapshot({"w": torch.full((256,), 2.0)}, training_state={"step": 2})
    shard = _shards(base / GENERATIONS / name)[0]
    plan_pieces, spoiled = reader.plan_pieces, []

    def spoil_then_plan(files, *args, **kwargs):  # runs right before the bytes are read into the tensors
        if not spoiled and files.name == name:
            _spoil(shard)
            spoiled.append(name)
        return plan_pieces(files, *args, **kwargs)

    monkeypatch.setattr(reader, "plan_pieces", spoil_then_plan)
    target = {"w": torch.zeros(256)}
    ckpt = load_latest(disk, state_dict=target)
    assert spoiled and (ckpt.tier, ckpt.training_state.step) == ("disk", 1), "the changed bytes were loaded"
    assert torch.equal(target["w"], torch.full((256,), 1.0))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.integers(min_value=0), flip=st.integers(min_value=1, max_value=255))
def test_any_flipped_byte_of_a_memory_shard_is_never_loaded(tmp_path_factory: pytest.TempPathFactory,
                                                           monkeypatch: pytest.MonkeyPatch, where: int,
                                                           flip: int) -> None:
    """Anywhere in the file (header, padding, data): the restore falls back to the disk checkpoint,
    whose values are what the state dict ends up holding."""
    tmp = tmp_path_factory.mktemp("flip")
    base, disk = tmp / "shm", str(tmp / "disk")
    base.mkdir()
    monkeypatch.setenv("ELASTICRUN_SNAPSHOT_DIR", str(base))
    older = {"w": torch.arange(300.0), "b": torch.full((5,), 7, dtype=torch.int64)}
    newer = {"w": torch.arange(300.0) + 0.5, "b": torch.full((5,), 9, dtype=torch.int64)}
    save(older, disk, training_state={"step": 1})
    name = Snapshotter().snapshot(newer, training_state={"step": 2})
    (shard,) = _shards(base / GENERATIONS / name)
    data = bytearray(shard.read_bytes())
    data[where % len(data)] ^= flip
    shard.write_bytes(bytes(data))
    target = {"w": torch.zeros(300), "b": torch.zeros(5, dtype=torch.int64)}
    ckpt = load_latest(disk, state_dict=target)
    assert ckpt.tier == "disk" and all(torch.equal(target[k], older[k]) for k in older), where % len(data)


def test_a_partial_restore_checks_the_parts_it_did_not_read_too(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Restoring some of the tensors reads part of a file; the rest is hashed afterwards: an intact
    file restores from memory, one changed only where nothing was read still counts as changed."""
    base, disk = tmp_path / "shm", str(tmp_path / "disk")
    base.mkdir()
    monkeypatch.setenv("ELASTICRUN_SNAPSHOT_DIR", str(base))
    save({"a": torch.zeros(1000), "z": torch.zeros(1000)}, disk, training_state={"step": 1})
    name = Snapshotter().snapshot({"a": torch.full((1000,), 3.0), "z": torch.full((1000,), 4.0)},
                                  training_state={"step": 2})
    only_a = {"a": torch.zeros(1000)}
    assert load_latest(disk, state_dict=only_a).tier == "memory" and torch.equal(only_a["a"], torch.full((1000,), 3.0))
    (shard,) = _shards(base / GENERATIONS / name)
    with open(shard, "r+b") as f:
        header, start = read_header(f, str(shard))
        key = next(k for k in header if k != "__metadata__" and k.startswith("z"))
        f.seek(start + header[key]["data_offsets"][0] + 40)
        f.write(NAN)  # inside tensor "z", which this restore does not read
    only_a = {"a": torch.zeros(1000)}
    assert load_latest(disk, state_dict=only_a).tier == "disk" and not only_a["a"].any()


def test_checked_file_hashes_reads_from_several_threads_and_refuses_a_byte_read_twice(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from elasticrun.checkpoint.checksum import Checksum, digest_of
    from elasticrun.checkpoint.format import FileEntry
    from elasticrun.checkpoint.memory import integrity

    data = bytes(range(256)) * 9000  # 2.3 MB: several STEP blocks
    path = tmp_path / "f.safetensors"
    path.write_bytes(data)
    entry = FileEntry(path.name, 0, len(data), digest_of(Checksum.WORDSUM, data), Checksum.WORDSUM)
    parts = [(0, 1 << 20), (1 << 20, 5), (2 << 20, 12345), ((1 << 20) + 5, 3)]  # out of order; gaps stay
    f = integrity.CheckedFile(str(path))
    try:
        def read(part):
            f.seek(part[0])
            buf = bytearray(part[1])
            assert f.readinto(buf) == part[1] and bytes(buf) == data[part[0]:part[0] + part[1]]

        with ThreadPoolExecutor(3) as pool:
            list(pool.map(read, parts))
        assert f.read(0) == b"" and f.problem(entry) is None  # the gaps were hashed for the check
        with pytest.raises(OSError):
            f.fileno()  # the reader must come through readinto, where the hashing is
        f.seek(10)
        f.read(4)  # inside the first part: read twice
        assert "read twice" in (f.problem(entry) or "")
    finally:
        f.release()
    g = integrity.CheckedFile(str(path))
    try:
        g.read()
        with open(path, "r+b") as w:
            w.write(b"\xff")  # after the read: the bytes loaded were fine, the file no longer is
        assert g.problem(entry) is None  # what was loaded matched
        g2 = integrity.CheckedFile(str(path))
        assert g2.problem(entry) == "its wordsum does not match"
        g2.release()
        path.write_bytes(data[:-1])
        assert "bytes, not" in (g.problem(entry) or "")
    finally:
        g.release()
