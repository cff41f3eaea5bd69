"""Single-process round trips: dtypes, odd shapes, nested structure, names, in-place loads."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from elasticrun.checkpoint import CheckpointError, Replicate, Shard, list_checkpoints, load, save, verify
from elasticrun.checkpoint.state import TrainingState


def _state():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "model": {
            "f32": torch.randn(3, 4, generator=g),
            "f64": torch.randn(2, generator=g, dtype=torch.float64),
            "f16": torch.randn(5, generator=g).half(),
            "bf16": torch.randn(4, 3, generator=g).bfloat16(),
            "i64": torch.arange(-5, 5),
            "i32": torch.arange(7, dtype=torch.int32),
            "i16": torch.arange(3, dtype=torch.int16),
            "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
            "u8": torch.tensor([0, 255], dtype=torch.uint8),
            "bool": torch.tensor([True, False, True]),
            "f8": torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn),
            "c64": torch.randn(3, dtype=torch.complex64, generator=g),
            "scalar": torch.tensor(3.25),
            "empty": torch.empty(0, 5),
            "empty1d": torch.empty(0, dtype=torch.bfloat16),
            "transposed": base.t(),
            "strided": base[::2, 1::3],
            "expanded": torch.randn(1, 4, generator=g).expand(3, 4),
        },
        "optim": {"state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.ones(3)}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "rng": torch.get_rng_state(),
        "sampler": {"epoch": 2, "offset": 1234, "seed": None, "done": False, "ratio": float("inf")},
    }


def _assert_equal(a, b, path=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), path
    elif isinstance(a, dict):
        assert type(b) is dict and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _assert_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{path}.{i}")
    else:
        assert a == b, (path, a, b)


def test_round_trip_everything(tmp_path):
    state = _state()
    ts = TrainingState(epoch=2, step=1200, samples_consumed=9600, learning_rate=0.1, global_batch_size=8)
    name = save(state, tmp_path, training_state=ts, user_metadata={"git": "abc", "loss": 0.5})
    assert name == "step-00001200"
    res = load(tmp_path)
    assert res.name == name and res.world_size == 1
    assert res.training_state.step == 1200 and res.training_state.learning_rate == 0.1
    assert res.user_metadata == {"git": "abc", "loss": 0.5}
    _assert_equal(state, res.state_dict)
    assert list(res.state_dict["optim"]["state"]) == [0]  # int keys stay ints


def test_every_shard_is_plain_safetensors_with_slice_offsets(tmp_path):
    save({"a": torch.arange(12.0).reshape(3, 4), "b": torch.tensor(1)}, tmp_path, "x", placements={"a": Shard(1)})
    path = tmp_path / "x" / "shard-00000-of-00001.safetensors"
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["a", "b"]
        assert torch.equal(f.get_tensor("a"), torch.arange(12.0).reshape(3, 4))
        meta = f.metadata()
    slices = json.loads(meta["slices"])
    assert slices["a"] == {"offsets": [0, 0], "global_shape": [3, 4]} and meta["checkpoint"] == "x"
    index = json.loads((tmp_path / "x" / "metadata.json").read_text())
    assert index["tensors"]["a"]["placement"] == {"type": "shard", "dim": 1}
    assert index["files"]["shard-00000-of-00001.safetensors"]["size"] == path.stat().st_size


def test_load_in_place_keeps_identity_and_converts(tmp_path):
    save({"w": torch.arange(6.0).reshape(2, 3), "n": 5, "h": torch.ones(2)}, tmp_path, "c")
    w = torch.zeros(2, 3)
    h = torch.zeros(2, dtype=torch.float64)  # other dtype: copied with conversion
    target = {"w": w, "n": 0, "h": h}
    res = load(tmp_path, "c", state_dict=target)
    assert res.state_dict is target and target["w"] is w and torch.equal(w, torch.arange(6.0).reshape(2, 3))
    assert target["n"] == 5 and target["h"] is h and torch.equal(h, torch.ones(2, dtype=torch.float64))
    with pytest.raises(CheckpointError, match="has no tensor 'zz'"):
        load(tmp_path, "c", state_dict={"zz": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"shape \(2, 3\) but the state dict has \(3, 2\)"):
        load(tmp_path, "c", state_dict={"w": torch.zeros(3, 2)})


def test_load_with_placements_gives_a_slice(tmp_path):
    t = torch.arange(20.0).reshape(4, 5)
    save({"t": t}, tmp_path, "p")
    assert torch.equal(load(tmp_path, "p", placements={"t": Shard(1)}).state_dict["t"], t)  # world 1: all of it
    assert torch.equal(load(tmp_path, "p", placements={"t": Replicate()}).state_dict["t"], t)


@pytest.mark.parametrize("bad", ["../evil", "a/b", "/abs", ".hidden", "latest", "", "x" * 201, "a\\b", "..", "sp ace"])
def test_bad_names_are_refused_and_nothing_is_written(tmp_path, bad):
    root = tmp_path / "root"
    with pytest.raises(CheckpointError, match="invalid checkpoint name"):
        save({"a": torch.zeros(1)}, root, bad)
    assert not root.exists() or os.listdir(root) == []
    assert sorted(os.listdir(tmp_path)) == ["root"] or sorted(os.listdir(tmp_path)) == []
    with pytest.raises(CheckpointError):
        load(root, bad)


def test_existing_name_is_not_overwritten(tmp_path):
    save({"a": torch.zeros(2)}, tmp_path, "same")
    with pytest.raises(CheckpointError, match="already exists"):
        save({"a": torch.ones(2)}, tmp_path, "same")
    assert torch.equal(load(tmp_path, "same").state_dict["a"], torch.zeros(2))
    assert [i.name for i in list_checkpoints(tmp_path)] == ["same"]


def test_unsupported_values_are_refused_without_pickle(tmp_path):
    with pytest.raises(CheckpointError, match=r"'cfg.obj' has type object"):
        save({"cfg": {"obj": object()}}, tmp_path, "x")
    with pytest.raises(CheckpointError, match="placements names 'nope'"):
        save({"a": torch.zeros(1)}, tmp_path, "x", placements={"nope": Shard(0)})
    with pytest.raises(CheckpointError, match="Shard.3. but has 1 dimensions"):
        save({"a": torch.zeros(1)}, tmp_path, "x", placements={"a": Shard(3)})
    with pytest.raises(CheckpointError, match="keep_last must be a positive integer"):
        save({"a": torch.zeros(1)}, tmp_path, "x", keep_last=0)
    assert list_checkpoints(tmp_path) == []
    assert [p for p in os.listdir(tmp_path)] == []


def test_latest_is_the_newest_complete_and_missing_names_are_clear(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load(tmp_path)
    for step in (1, 2, 3):
        save({"s": torch.tensor(step)}, tmp_path, training_state={"step": step})
    assert load(tmp_path).name == "step-00000003" and int(load(tmp_path).state_dict["s"]) == 3
    (tmp_path / ".step-00000004.tmp-abc").mkdir()  # a save in progress
    (tmp_path / "step-00000005").mkdir()  # never committed
    infos = {i.name: i for i in list_checkpoints(tmp_path)}
    assert infos["step-00000003"].latest and infos["step-00000004"].status == "incomplete"
    assert infos["step-00000005"].status == "incomplete"
    assert load(tmp_path).name == "step-00000003"
    with pytest.raises(CheckpointError, match="is incomplete"):
        load(tmp_path, "step-00000005")
    with pytest.raises(CheckpointError, match="no checkpoint 'nope'"):
        load(tmp_path, "nope")


@pytest.mark.parametrize("algo", [None, "sha256"])
def test_file_checksum_is_that_of_the_bytes_on_disk_with_mixed_sizes(tmp_path, algo):
    import hashlib
    import zlib

    # big (hashed on the helper thread) then small (must still be hashed after it, in order)
    state = {"a_big": torch.randn(600, 1000), "b_small": torch.ones(3), "c_big": torch.randn(300, 1000)}
    save(state, tmp_path, "h", checksum=algo)
    index = json.loads((tmp_path / "h" / "metadata.json").read_text())
    assert index["version"] == 2
    for fname, entry in index["files"].items():
        data = (tmp_path / "h" / fname).read_bytes()
        if algo == "sha256":
            assert set(entry) == {"rank", "size", "sha256"}
            assert hashlib.sha256(data).hexdigest() == entry["sha256"]
        else:  # the default
            assert set(entry) == {"rank", "size", "crc32"}
            assert f"{zlib.crc32(data):08x}" == entry["crc32"]


def _mapped_files() -> set:
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[-1].strip() for line in f if ".safetensors" in line}


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_fresh_loads_map_the_files_copy_on_write(tmp_path):
    state = {"w": torch.randn(64, 64), "odd": torch.arange(3, dtype=torch.float16), "after": torch.ones(5)}
    save(state, tmp_path, "c")
    shard = str(tmp_path / "c" / "shard-00000-of-00001.safetensors")
    loaded = load(tmp_path, "c").state_dict
    assert shard in _mapped_files()  # zero-copy: the tensors are views of the file's pages
    _assert_equal(state, loaded)  # "after" follows 6 bytes of float16: unaligned, so copied instead
    loaded["w"].fill_(7.0)  # private mapping: writing never reaches the file
    assert verify(tmp_path, "c").ok and torch.equal(load(tmp_path, "c", mmap=False).state_dict["w"], state["w"])
    del loaded
    import gc

    gc.collect()
    copied = load(tmp_path, "c", mmap=False).state_dict
    assert shard not in _mapped_files()
    _assert_equal(state, copied)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_files_on_network_filesystems_are_read_not_mapped(tmp_path, monkeypatch):
    from elasticrun.checkpoint import storage

    assert storage.filesystem_type("/proc/self") == "proc"
    assert not storage.LocalStorage("/proc/elasticrun-nothing").mappable
    state = {"w": torch.randn(32, 32)}
    save(state, tmp_path, "c")
    monkeypatch.setattr(storage, "LOCAL_FILESYSTEMS", set())  # as if tmp_path were NFS: never map
    loaded = load(tmp_path, "c").state_dict
    assert str(tmp_path / "c" / "shard-00000-of-00001.safetensors") not in _mapped_files()
    assert torch.equal(loaded["w"], state["w"])
