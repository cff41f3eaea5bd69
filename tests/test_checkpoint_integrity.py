"""Corruption is caught and named: flipped bytes, truncated metadata, garbage or missing shards."""

from __future__ import annotations

import json

import pytest
import torch

from elasticrun.checkpoint import CheckpointError, list_checkpoints, load, save, verify

pytestmark = pytest.mark.integration  # starts etcd or processes

SHARD = "shard-00000-of-00001.safetensors"


@pytest.fixture
def root(tmp_path):
    save({"a": torch.arange(1000.0), "b": torch.ones(10, 10)}, tmp_path, "old")
    save({"a": torch.arange(1000.0) * 2, "b": torch.zeros(10, 10)}, tmp_path, "new")
    return tmp_path


def _flip(path, offset_from_end=100):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_caught_by_verify_and_load(root):
    assert verify(root, "new").ok
    _flip(root / "new" / SHARD)
    result = verify(root, "new")
    assert not result.ok and len(result.problems) == 1
    assert SHARD in result.problems[0] and "corrupt" in result.problems[0]
    with pytest.raises(CheckpointError, match=f"{SHARD} of checkpoint 'new' is corrupt"):
        load(root, "new")
    # Skipping verification reads the (wrong) data: the flag is honoured.
    assert not torch.equal(load(root, "new", verify=False).state_dict["b"], torch.zeros(10, 10))  # b is stored last
    assert verify(root, "old").ok and torch.equal(load(root, "old").state_dict["a"], torch.arange(1000.0))


def test_truncated_metadata_is_corrupt(root):
    meta = root / "new" / "metadata.json"
    meta.write_bytes(meta.read_bytes()[:50])
    infos = {i.name: i for i in list_checkpoints(root)}
    assert infos["new"].status == "corrupt" and "not valid JSON" in infos["new"].problem
    assert infos["old"].latest  # the corrupt one is never "latest"
    assert load(root).name == "old"
    with pytest.raises(CheckpointError, match="metadata.json is not valid JSON.*corrupt"):
        load(root, "new")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        verify(root, "new")


def test_wrong_metadata_schema_is_corrupt(root):
    (root / "new" / "metadata.json").write_text('{"format": "elasticrun-checkpoint", "version": 1}')
    with pytest.raises(CheckpointError, match="malformed.*KeyError"):
        load(root, "new")
    (root / "new" / "metadata.json").write_text('{"format": "elasticrun-checkpoint", "version": 99}')
    with pytest.raises(CheckpointError, match="format version 99.*upgrade"):
        load(root, "new")


def test_garbage_shard_is_rejected(root):
    shard = root / "new" / SHARD
    size = shard.stat().st_size
    shard.write_bytes(b"\xff" * size)  # same size: only the hash (or the header) can tell
    assert SHARD in verify(root, "new").problems[0]
    with pytest.raises(CheckpointError, match=f"{SHARD} of checkpoint 'new' is corrupt"):
        load(root, "new")
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load(root, "new", verify=False)
    shard.write_bytes(b"garbage")
    assert {i.name: i for i in list_checkpoints(root)}["new"].status == "corrupt"
    with pytest.raises(CheckpointError, match="has 7 bytes, metadata says"):
        load(root, "new")


def test_missing_shard(root):
    (root / "new" / SHARD).unlink()
    info = {i.name: i for i in list_checkpoints(root)}["new"]
    assert info.status == "corrupt" and "missing" in info.problem
    with pytest.raises(CheckpointError, match=f"{SHARD} of checkpoint 'new' is missing"):
        load(root, "new")


def test_stale_round_cannot_commit(etcd, job_id, tmp_path, monkeypatch):
    """Fencing: a worker whose round is no longer the job's current one gets no checkpoint."""
    import torch

    import elasticrun.train  # noqa: F401 - installs the commit fence (its etcd read)
    from elasticrun.checkpoint import list_checkpoints, save
    from elasticrun.errors import CheckpointError
    from elasticrun.job.keys import JobKeys

    etcd.put_json(JobKeys(job_id).topology, {"round": 3})
    monkeypatch.setenv("ELASTICRUN_RDZV_ENDPOINT", etcd.endpoints)
    monkeypatch.setenv("ELASTICRUN_RDZV_ID", job_id)
    monkeypatch.setenv("ELASTICRUN_ROUND", "2")
    with pytest.raises(CheckpointError, match="stale round"):
        save({"w": torch.ones(3)}, str(tmp_path), "stale")
    assert not (tmp_path / "stale").exists()
    assert [c.name for c in list_checkpoints(str(tmp_path))] == []
    monkeypatch.setenv("ELASTICRUN_ROUND", "3")
    assert save({"w": torch.ones(3)}, str(tmp_path), "current") == "current"


def test_file_names_in_metadata_cannot_leave_the_checkpoint(root):
    meta_path = root / "new" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    (root / "outside.safetensors").write_bytes((root / "new" / SHARD).read_bytes())
    meta["files"] = {"../outside.safetensors": meta["files"][SHARD]}
    for t in meta["tensors"].values():
        for c in t["chunks"]:
            c["file"] = "../outside.safetensors"
    meta_path.write_text(json.dumps(meta))
    for call in (lambda: load(root, "new", verify=False), lambda: verify(root, "new")):
        with pytest.raises(CheckpointError, match="'../outside.safetensors', which is not a plain file name"):
            call()
    assert {i.name: i.status for i in list_checkpoints(root)}["new"] == "corrupt"
