"""Per-file checksums: crc32 by default, sha256 on request, version-1 (sha256) checkpoints still
read; every path that reads a file (load fresh, load in place, verify, reshard) catches a
flipped byte with either algorithm."""

from __future__ import annotations

import hashlib
import json
import zlib

import pytest
import torch

from elasticrun.checkpoint import CheckpointError, Checksum, load, save, verify
from elasticrun.checkpoint.checksum import Digest, digest_of, file_digest, parse_checksum
from elasticrun.checkpoint.consolidate import import_file, reshard

from helpers.ckpt import cli

SHARD = "shard-00000-of-00001.safetensors"


def _state() -> dict:
    return {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.ones(7), "step": 3}


def _meta(root, name) -> dict:
    return json.loads((root / name / "metadata.json").read_text())


def _flip(path, offset_from_end: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x10
    path.write_bytes(bytes(data))


def test_digest_matches_zlib_and_hashlib_in_pieces():
    data = bytes(range(256)) * 300
    for algo, ref in ((Checksum.CRC32, f"{zlib.crc32(data):08x}"), (Checksum.SHA256, hashlib.sha256(data).hexdigest())):
        d = Digest(algo)
        for a in range(0, len(data), 1000):
            d.update(memoryview(data)[a:a + 1000])
        assert d.hexdigest() == ref == digest_of(algo, data)
        assert algo.is_digest(ref) and not algo.is_digest(ref.upper()) and not algo.is_digest(ref[:-1])


def test_file_digest_overlapped_reads_every_block_once_in_order(monkeypatch):
    from elasticrun.checkpoint import checksum

    monkeypatch.setattr(checksum, "DIGEST_BLOCK", 1000)
    data = bytes(range(251)) * 40  # 10040 bytes: 11 blocks, the last one short
    offsets, seen = [], []

    def read_into(off, view):
        offsets.append(off)
        view[:] = data[off:off + len(view)]

    got = file_digest(read_into, len(data), Checksum.CRC32, progress=seen.append)
    assert got == f"{zlib.crc32(data):08x}"
    assert offsets == list(range(0, len(data), 1000)) and sum(seen) == len(data)


def test_parse_checksum_names_the_choices():
    assert parse_checksum(None) is Checksum.CRC32 and parse_checksum("SHA256") is Checksum.SHA256
    with pytest.raises(CheckpointError, match="unknown checksum 'md5': use one of crc32, sha256"):
        parse_checksum("md5")


@pytest.mark.parametrize("algo", ["crc32", "sha256"])
def test_flipped_byte_is_caught_on_every_read_path(tmp_path, algo):
    save(_state(), tmp_path, "c", checksum=algo)
    entry = _meta(tmp_path, "c")["files"][SHARD]
    assert algo in entry and len(entry[algo]) == Checksum(algo).hex_length
    assert verify(tmp_path, "c").ok
    target = {"w": torch.zeros(64, 64), "b": torch.zeros(7), "step": 0}
    load(tmp_path, "c", state_dict=target)
    assert torch.equal(target["w"], _state()["w"])

    _flip(tmp_path / "c" / SHARD)
    result = verify(tmp_path, "c")
    assert not result.ok and f"its {algo} does not match" in result.problems[0]
    for kwargs in ({}, {"mmap": False}):
        with pytest.raises(CheckpointError, match=f"{SHARD} of checkpoint 'c' is corrupt: its {algo}"):
            load(tmp_path, "c", **kwargs)
    fresh = {"w": torch.zeros(64, 64), "b": torch.zeros(7), "step": 0}
    with pytest.raises(CheckpointError, match="is corrupt"):
        load(tmp_path, "c", state_dict=fresh)
    assert not fresh["w"].any() and not fresh["b"].any()  # verify before write: untouched
    with pytest.raises(CheckpointError, match="is corrupt"):
        reshard(tmp_path, "c", 2, str(tmp_path / "out"))


def test_version_1_checkpoints_with_sha256_still_load_and_verify(tmp_path):
    save(_state(), tmp_path, "old", checksum="sha256")
    doc = _meta(tmp_path, "old")
    doc["version"] = 1  # what elasticrun 0.1 wrote: the same layout, sha256 only
    (tmp_path / "old" / "metadata.json").write_text(json.dumps(doc))
    assert verify(tmp_path, "old").ok
    assert torch.equal(load(tmp_path, "old").state_dict["w"], _state()["w"])
    # ...but a version-1 file never carried crc32: such metadata is corrupt, not silently trusted
    save(_state(), tmp_path, "new")
    doc = _meta(tmp_path, "new")
    doc["version"] = 1
    (tmp_path / "new" / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="must carry a sha256.*corrupt"):
        load(tmp_path, "new")


def test_metadata_with_two_or_no_checksums_is_malformed(tmp_path):
    save(_state(), tmp_path, "c")
    doc = _meta(tmp_path, "c")
    doc["files"][SHARD]["sha256"] = "0" * 64
    (tmp_path / "c" / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="exactly one checksum"):
        verify(tmp_path, "c")
    del doc["files"][SHARD]["sha256"], doc["files"][SHARD]["crc32"]
    (tmp_path / "c" / "metadata.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="exactly one checksum"):
        load(tmp_path, "c")


def test_reshard_keeps_the_source_algorithm_and_import_takes_one(tmp_path):
    save(_state(), tmp_path, "c", checksum="sha256")
    new = reshard(tmp_path, "c", 2, str(tmp_path / "out"))
    files = _meta(tmp_path / "out", new)["files"]
    assert len(files) >= 1 and all("sha256" in e for e in files.values())
    torch.save({"w": torch.ones(3)}, tmp_path / "m.pt")
    import_file(str(tmp_path / "m.pt"), str(tmp_path / "imp"), "x", checksum="sha256")
    assert all("sha256" in e for e in _meta(tmp_path / "imp", "x")["files"].values())
    with pytest.raises(CheckpointError, match="unknown checksum"):
        save(_state(), tmp_path, "bad", checksum="md5")
    assert not (tmp_path / "bad").exists()


@pytest.mark.integration
def test_cli_verify_names_the_algorithm_and_import_rejects_an_unknown_one(tmp_path):
    save(_state(), tmp_path, "c")
    out = cli("verify", str(tmp_path), "c")
    assert out.returncode == 0 and "match their crc32" in out.stdout
    torch.save({"w": torch.ones(3)}, tmp_path / "m.pt")
    bad = cli("save", "--from", str(tmp_path / "m.pt"), str(tmp_path / "imp"), "x", "--checksum", "md5")
    assert bad.returncode != 0 and "unknown checksum 'md5'" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "imp" / "x").exists()
