"""Staged transfers and the in-place load's dry pass: the double-buffered rotation that moves
bytes between files and device tensors (run here with CPU buffers, the same code the CUDA
path runs with pinned ones), targets that need a bounce (another dtype, not contiguous),
and checks that must fail before any byte reaches the caller's tensors. Real files; the
CUDA rows run only where a GPU is present."""

from __future__ import annotations

import hashlib
import json
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from elasticrun.checkpoint import AsyncCheckpointer, CheckpointError, load, save, staging
from elasticrun.checkpoint import plan as plan_mod
from elasticrun.checkpoint.checksum import Checksum
from elasticrun.checkpoint.load_into import digest_file
from elasticrun.checkpoint.staging import DeviceStager, host_pieces

from helpers.ckpt import reference_wordsum


def _mixed(seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    state = {
        "emb": torch.randn(300, 17, generator=g).to(torch.bfloat16),
        "ln.bias": torch.randn(17, generator=g),
        "w": torch.randn(64, 33, generator=g, dtype=torch.float64),
        "empty": torch.empty(0, 5),
        "steps": torch.arange(1000, dtype=torch.int64),
    }
    return {k: v.to(device) for k, v in state.items()}


@pytest.fixture
def small_stage(monkeypatch):
    monkeypatch.setattr(staging, "STAGE_BYTES", 1000)  # odd, so chunks end mid-element and mid-tensor


def test_host_pieces_stream_every_byte_in_order_through_two_buffers(small_stage):
    tensors = list(_mixed().values())
    expected = b"".join(bytes(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors)
    chunks = -(-len(expected) // 1000)  # small tensors are packed: every buffer but the last is full
    digest = hashlib.sha256()
    pending = {}
    released = []

    def hash_later(view):  # an asynchronous consumer that reads the staging buffer itself, late
        time.sleep(0.002)
        digest.update(view)

    def before_reuse(j):
        released.append(j)
        for k in [k for k in pending if k <= j]:
            pending.pop(k).result()

    with ThreadPoolExecutor(1) as pool:  # one worker: in order, like the writer's hashing helper
        for j, view in enumerate(host_pieces(tensors, before_reuse, piece=1000, stage_cpu=True)):
            assert len(view) == 1000 or j == chunks - 1
            pending[j] = pool.submit(hash_later, view)
    assert digest.hexdigest() == hashlib.sha256(expected).hexdigest()
    assert released == sorted(released) and released[-1] == chunks - 1 and j == chunks - 1


def test_host_pieces_keep_cpu_tensors_between_staged_ones_in_order(small_stage):
    tensors = list(_mixed(7).values())
    expected = b"".join(bytes(t.reshape(-1).view(torch.uint8).numpy()) for t in tensors)
    got = []
    for view in host_pieces(tensors[:2], lambda j: None, piece=1000, stage_cpu=True):
        got.append(bytes(view))
    for view in host_pieces(tensors[2:], lambda j: None, piece=700):  # not staged: views, 700 at most
        assert len(view) <= 700
        got.append(bytes(view))
    assert b"".join(got) == expected


def test_host_pieces_without_staging_are_views_of_the_tensors():
    t = torch.arange(100, dtype=torch.int32)
    views = list(host_pieces([t], lambda j: None, piece=64))
    assert b"".join(bytes(v) for v in views) == bytes(t.numpy())
    t[0] = 42
    assert bytes(views[0])[:4] == struct.pack("<i", 42)  # no copy was made


def test_device_stager_copies_file_ranges_across_chunk_boundaries(tmp_path, small_stage):
    data = bytes(range(256)) * 37
    path = tmp_path / "blob"
    path.write_bytes(data)
    dst = torch.zeros(len(data) - 100, dtype=torch.uint8)
    st = DeviceStager(torch.device("cpu"))
    with open(path, "rb", buffering=0) as f:
        st.copy(f, 50, dst[:3001], "blob")
        st.copy(f, 3051, dst[3001:], "blob")
        with pytest.raises(CheckpointError, match="truncated"):
            st.copy(f, len(data) - 10, torch.zeros(20, dtype=torch.uint8), "blob")
    st.finish()
    assert bytes(dst.numpy()) == data[50:-50]


def test_device_stager_packs_neighbouring_small_ranges_and_streams_large_ones(tmp_path, small_stage):
    data = bytes(range(251)) * 40  # 10040 bytes
    path = tmp_path / "blob"
    path.write_bytes(data)
    # (offset, length): adjacent small ones (packed into shared reads), a gap, a large one (> 1000/4,
    # streamed in 1000-byte chunks), and one that would overflow a buffer if packed
    spans = [(10, 30), (40, 5), (45, 200), (300, 7), (307, 2500), (2807, 240), (3047, 240), (3287, 240),
             (3527, 240), (3767, 240), (9000, 1)]
    dsts = [torch.zeros(n, dtype=torch.uint8) for _, n in spans]
    st = DeviceStager(torch.device("cpu"))
    with open(path, "rb", buffering=0) as f:
        st.copy_many(f, list(reversed([(off, d) for (off, _), d in zip(spans, dsts)])), "blob")
    st.finish()
    for (off, n), d in zip(spans, dsts):
        assert bytes(d.numpy()) == data[off:off + n], (off, n)


@pytest.mark.parametrize("algo", list(Checksum))
def test_overlapped_file_digest_matches_hashlib_and_zlib(tmp_path, monkeypatch, algo):
    from elasticrun.checkpoint import checksum, load_into

    monkeypatch.setattr(checksum, "DIGEST_BLOCK", 4096)
    monkeypatch.setattr(load_into, "cpu_share", lambda: 2)  # the helper-thread path even on one core
    data = bytes(range(256)) * 1000
    (tmp_path / "f").write_bytes(data)

    def reference(b: bytes) -> str:
        if algo is Checksum.WORDSUM:
            return reference_wordsum(b)
        return hashlib.sha256(b).hexdigest() if algo is Checksum.SHA256 else f"{zlib.crc32(b):08x}"

    with open(tmp_path / "f", "rb", buffering=0) as f:
        assert digest_file(f, len(data), "f", algo) == reference(data)
        assert digest_file(f, 5000, "f", algo) == reference(data[:5000])
        with pytest.raises(CheckpointError, match="truncated"):
            digest_file(f, len(data) + 10, "f", algo)


def test_in_place_load_bounces_targets_of_another_dtype_or_layout(tmp_path):
    state = _mixed(1)
    save(state, tmp_path, "x")
    target = {
        "emb": torch.zeros(300, 17, dtype=torch.float32),  # bf16 on disk: converted by copy_
        "ln.bias": torch.zeros(17),
        "w": torch.zeros(33, 64, dtype=torch.float64).t(),  # not contiguous
        "empty": torch.zeros(0, 5),
        "steps": torch.zeros(1000, dtype=torch.int64),
    }
    w_id = id(target["w"])
    load(tmp_path, "x", state_dict=target)
    assert torch.equal(target["emb"], state["emb"].float())
    assert torch.equal(target["w"], state["w"]) and id(target["w"]) == w_id
    assert torch.equal(target["steps"], state["steps"]) and torch.equal(target["ln.bias"], state["ln.bias"])


@pytest.fixture
def several_files(monkeypatch):
    monkeypatch.setattr(plan_mod, "MIN_PART_BYTES", 1 << 10)  # a small state still becomes several files


def _sentinels(state):
    return {k: torch.full_like(v, 7) for k, v in state.items()}


def test_a_bad_file_among_several_leaves_every_tensor_unchanged(tmp_path, several_files):
    state = _mixed(2)
    save(state, tmp_path, "x", io_threads=3)
    files = sorted(p for p in (tmp_path / "x").iterdir() if p.suffix == ".safetensors")
    assert len(files) >= 2
    good = _sentinels(state)
    load(tmp_path, "x", state_dict=good, io_threads=3)
    assert all(torch.equal(good[k], v) for k, v in state.items())
    data = bytearray(files[-1].read_bytes())
    data[-3] ^= 0x01
    files[-1].write_bytes(bytes(data))
    target = _sentinels(state)
    with pytest.raises(CheckpointError, match="corrupt"):
        load(tmp_path, "x", state_dict=target, io_threads=3)
    assert all(bool(torch.all(t == 7)) for t in target.values() if t.numel())


def test_a_header_that_disagrees_with_the_metadata_fails_before_any_write_even_unverified(tmp_path):
    state = _mixed(3)
    save(state, tmp_path, "x")
    shard = tmp_path / "x" / "shard-00000-of-00001.safetensors"
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["steps"]["shape"], header["steps"]["data_offsets"] = [500], [
        header["steps"]["data_offsets"][0], header["steps"]["data_offsets"][0] + 4000]
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n
    shard.write_bytes(raw[:8] + new + raw[8 + n:])
    target = _sentinels(state)
    with pytest.raises(CheckpointError, match="does not match metadata.json"):
        load(tmp_path, "x", state_dict=target, verify=False)
    assert all(bool(torch.all(t == 7)) for t in target.values() if t.numel())


def test_a_save_that_crosses_the_writeback_batch_reads_back(tmp_path, monkeypatch):
    from elasticrun.checkpoint import shardfile

    monkeypatch.setattr(shardfile, "WRITEBACK", 100)
    monkeypatch.setattr(shardfile, "PIECE", 333)
    state = _mixed(4)
    save(state, tmp_path, "x")
    out = load(tmp_path, "x").state_dict
    assert all(torch.equal(out[k], v) for k, v in state.items())


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
def test_cuda_state_saves_and_loads_into_cuda_tensors(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "STAGE_BYTES", 4096)
    state = _mixed(5, "cuda")
    state["big"] = torch.randn(3000, 7, device="cuda")
    save(state, tmp_path, "x")
    cpu = load(tmp_path, "x").state_dict
    assert all(torch.equal(cpu[k], v.cpu()) for k, v in state.items())
    target = {k: torch.full_like(v, 7) for k, v in state.items()}
    load(tmp_path, "x", state_dict=target)
    assert all(t.is_cuda and torch.equal(t, state[k]) for k, t in target.items())


@pytest.mark.gpu
@cuda
def test_cuda_async_save_snapshots_into_reused_pinned_buffers(tmp_path):
    state = _mixed(6, "cuda")
    with AsyncCheckpointer() as ckpt:
        ckpt.save(state, tmp_path, "a").result()
        bufs = {k: b.data_ptr() for k, b in ckpt._buffers.items()}
        assert all(b.is_pinned() for b in ckpt._buffers.values() if b.numel())
        state["w"].add_(1)  # the next save must see this step's values
        ckpt.save(state, tmp_path, "b").result()
        assert {k: b.data_ptr() for k, b in ckpt._buffers.items()} == bufs
    out = load(tmp_path, "b").state_dict
    assert torch.equal(out["w"], state["w"].cpu())
