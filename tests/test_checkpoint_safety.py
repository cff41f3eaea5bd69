"""Checkpoint safety: aliases (symlinks) are never followed by deletion, ``--incomplete`` only
touches this format's directories, ordering is by step then commit sequence (never a clock),
a failed in-place load leaves the caller's tensors untouched, and a full disk reclaims the
temporary directories of dead saves before its one retry. Real files, real processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import uuid

import pytest
import torch

from elasticrun.checkpoint import CheckpointError, Shard, delete, list_checkpoints, load, save
from elasticrun.checkpoint import storage as storage_mod
from elasticrun.checkpoint.format import INCOMPLETE_MARKER
from elasticrun.checkpoint.temps import _boot_id

from helpers.ckpt import child_env, cli

pytestmark = pytest.mark.integration  # starts etcd or processes


def _steps(root, steps, size=4):
    for s in steps:
        save({"w": torch.full((size,), float(s))}, root, training_state={"step": s})


def _loadable(root):
    return [i.name for i in list_checkpoints(root) if i.status == "complete"]  # aliases have status "alias"


def _meta(root, name):
    return root / name / "metadata.json"


# -- aliases ---------------------------------------------------------------------------------


def test_keep_last_with_an_alias_keeps_the_aliased_checkpoint_intact(tmp_path):
    _steps(tmp_path, (1, 2, 3))
    os.symlink("step-00000001", tmp_path / "best")
    res = cli("delete", str(tmp_path), "--keep-last", "1", "--yes")
    assert res.returncode == 0, res.stderr
    assert _meta(tmp_path, "step-00000001").is_file(), "retention removed the aliased checkpoint's metadata"
    assert _loadable(tmp_path) == ["step-00000001", "step-00000003"]
    assert float(load(tmp_path, "best").state_dict["w"][0]) == 1.0
    assert load(tmp_path).name == "step-00000003"  # an alias is never "latest"
    infos = {i.name: i for i in list_checkpoints(tmp_path)}
    assert infos["best"].alias_of == "step-00000001" and not infos["best"].latest
    assert infos["best"].status == "alias" and "best" in cli("list", str(tmp_path)).stdout


def test_save_retention_ignores_aliases(tmp_path):
    _steps(tmp_path, (1, 2))
    os.symlink("step-00000002", tmp_path / "best")
    save({"w": torch.zeros(4)}, tmp_path, training_state={"step": 3}, keep_last=1)
    assert _loadable(tmp_path) == ["step-00000002", "step-00000003"]
    assert os.path.islink(tmp_path / "best") and load(tmp_path, "best").name == "best"


def test_deleting_an_alias_removes_only_the_link(tmp_path):
    _steps(tmp_path, (1, 2))
    os.symlink("step-00000001", tmp_path / "best")
    outside = tmp_path.parent / f"outside-{uuid.uuid4().hex[:6]}"
    shutil.copytree(tmp_path / "step-00000002", outside)
    os.symlink(outside, tmp_path / "ext")
    try:
        res = cli("delete", str(tmp_path), "best", "ext", "--yes")
        assert res.returncode == 0, res.stderr
        assert not os.path.lexists(tmp_path / "best") and not os.path.lexists(tmp_path / "ext")
        assert (outside / "metadata.json").is_file()  # a link out of the root: its target is untouched
        assert _loadable(tmp_path) == ["step-00000001", "step-00000002"]
    finally:
        shutil.rmtree(outside)


def test_deleting_an_aliased_checkpoint_needs_force(tmp_path):
    _steps(tmp_path, (1, 2))
    os.symlink("step-00000001", tmp_path / "best")
    with pytest.raises(CheckpointError, match="alias"):
        delete(str(tmp_path), ["step-00000001"])
    assert _loadable(tmp_path) == ["step-00000001", "step-00000002"]
    assert delete(str(tmp_path), ["step-00000001", "best"]) == ["step-00000001", "best"]


def test_a_symlink_inside_a_checkpoint_is_not_followed(tmp_path):
    _steps(tmp_path, (1, 2, 3))
    # a hand-made checkpoint whose metadata.json is a link to another checkpoint's
    (tmp_path / "step-00000001" / "note").symlink_to(tmp_path / "step-00000003" / "metadata.json")
    assert delete(str(tmp_path), ["step-00000001"]) == ["step-00000001"]
    assert _meta(tmp_path, "step-00000003").is_file()


# -- --incomplete ----------------------------------------------------------------------------


def test_delete_incomplete_touches_only_this_formats_directories(tmp_path):
    _steps(tmp_path, (1,))
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "run.yaml").write_text("lr: 1\n")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / ".step-00000002.tmp-deadbeef").mkdir()
    half = tmp_path / "step-00000003"  # an object-store commit that crashed half-way (shards, no metadata)
    half.mkdir()
    (half / "shard-00000-of-00001.safetensors").write_bytes(b"x")
    marked = tmp_path / "step-00000004"
    marked.mkdir()
    (marked / INCOMPLETE_MARKER).write_text("{}")
    res = cli("delete", str(tmp_path), "--incomplete", "--yes")
    assert res.returncode == 0, res.stderr
    left = sorted(os.listdir(tmp_path))
    assert left == ["configs", "step-00000001", "tensorboard"], left
    assert (tmp_path / "configs" / "run.yaml").read_text() == "lr: 1\n"


def test_a_committed_checkpoint_has_no_incomplete_marker(tmp_path):
    _steps(tmp_path, (1,))
    assert not (tmp_path / "step-00000001" / INCOMPLETE_MARKER).exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


# -- ordering --------------------------------------------------------------------------------


def _set_created(root, name, created):
    doc = json.loads(_meta(root, name).read_text())
    doc["created"] = created
    _meta(root, name).write_text(json.dumps(doc))


def test_latest_and_retention_follow_the_step_not_the_clock(tmp_path):
    _steps(tmp_path, (1, 2))
    _set_created(tmp_path, "step-00000002", 1000.0)  # rank 0 of that round had a clock far behind
    assert load(tmp_path).name == "step-00000002"
    save({"w": torch.zeros(4)}, tmp_path, "extra", training_state={"step": 0}, keep_last=2)  # kept: just written
    assert _loadable(tmp_path) == ["extra", "step-00000001", "step-00000002"]  # step order, oldest first
    res = cli("delete", str(tmp_path), "--keep-last", "1", "--yes")
    assert res.returncode == 0 and _loadable(tmp_path) == ["step-00000002"]


def test_same_step_is_ordered_by_commit_sequence(tmp_path):
    save({"w": torch.zeros(2)}, tmp_path, "b", training_state={"step": 5})
    save({"w": torch.ones(2)}, tmp_path, "a", training_state={"step": 5})
    _set_created(tmp_path, "a", 1.0)
    seqs = {i.name: i.meta.seq for i in list_checkpoints(tmp_path)}
    assert seqs == {"a": 2, "b": 1}
    assert load(tmp_path).name == "a"


def test_checkpoints_without_a_sequence_number_stay_loadable(tmp_path):
    _steps(tmp_path, (1, 2))
    for name in ("step-00000001", "step-00000002"):
        doc = json.loads(_meta(tmp_path, name).read_text())
        del doc["seq"]  # as written before the sequence existed
        _meta(tmp_path, name).write_text(json.dumps(doc))
    assert load(tmp_path).name == "step-00000002"
    _steps(tmp_path, (3,))
    assert list_checkpoints(tmp_path)[-1].meta.seq == 1 and load(tmp_path).name == "step-00000003"


# -- verify before write ---------------------------------------------------------------------


def _state():
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(64, 8, generator=g), "b": torch.randn(1000, generator=g), "c": torch.arange(10)}


def _sentinel():
    return {"a": torch.full((64, 8), 7.0), "b": torch.full((1000,), 7.0), "c": torch.full((10,), 7)}


def _unchanged(target):
    return all(bool(torch.all(t == 7)) for t in target.values())


@pytest.mark.parametrize("mmap", [True, False])
def test_a_checksum_mismatch_leaves_the_callers_tensors_unchanged(tmp_path, mmap):
    save(_state(), tmp_path, "x")
    shard = tmp_path / "x" / "shard-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40
    shard.write_bytes(bytes(data))
    target = _sentinel()
    with pytest.raises(CheckpointError, match="corrupt"):
        load(tmp_path, "x", state_dict=target, mmap=mmap)
    assert _unchanged(target)


def test_a_missing_file_or_a_shape_error_leaves_the_callers_tensors_unchanged(tmp_path):
    save(_state(), tmp_path, "x", placements={"b": Shard(0)})
    wrong = _sentinel()
    wrong["c"] = torch.full((11,), 7)  # the last tensor does not fit: nothing may be written
    with pytest.raises(CheckpointError, match="shape"):
        load(tmp_path, "x", state_dict=wrong)
    assert _unchanged(wrong)
    os.remove(tmp_path / "x" / "shard-00000-of-00001.safetensors")
    target = _sentinel()
    with pytest.raises(CheckpointError):
        load(tmp_path, "x", state_dict=target)
    assert _unchanged(target)


def test_a_good_in_place_load_fills_every_tensor(tmp_path):
    save(_state(), tmp_path, "x")
    target = _sentinel()
    ids = {k: id(v) for k, v in target.items()}
    out = load(tmp_path, "x", state_dict=target)
    assert all(torch.equal(target[k], v) for k, v in _state().items())
    assert {k: id(v) for k, v in out.state_dict.items()} == ids


# -- disk full, stale temporaries, retries -------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


_MB12 = 314573  # float32 elements: 1.2 MiB, so two checkpoints fit on the 3 MiB disk, three do not


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_full_disk_reclaims_dead_saves_and_retries(small_disk):
    dead = small_disk / ".step-00000001.tmp-0123456789ab"
    dead.mkdir()
    (dead / INCOMPLETE_MARKER).write_text(json.dumps(
        {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": _dead_pid(), "started": 0}))
    (dead / "shard-00000-of-00001.safetensors").write_bytes(b"\0" * (2 << 20))
    live = small_disk / ".step-00000003.tmp-ba9876543210"  # a save still running here: never reclaimed
    live.mkdir()
    (live / INCOMPLETE_MARKER).write_text(json.dumps(
        {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": os.getpid(), "started": 0}))
    name = save({"w": torch.ones(_MB12)}, small_disk, training_state={"step": 2})
    assert name == "step-00000002" and not dead.exists() and live.exists()
    assert torch.all(load(small_disk).state_dict["w"] == 1)


def test_a_full_disk_applies_retention_before_the_retry(small_disk):
    for step in (1, 2):
        save({"w": torch.full((_MB12,), float(step))}, small_disk, training_state={"step": step})
    name = save({"w": torch.full((_MB12,), 3.0)}, small_disk, training_state={"step": 3}, keep_last=1)
    assert name == "step-00000003" and _loadable(small_disk) == ["step-00000003"]


def test_a_full_disk_without_room_fails_cleanly(small_disk):
    with pytest.raises(CheckpointError, match="No space left"):
        save({"w": torch.ones(1 << 20)}, small_disk, "big")  # 4 MiB on a 3 MiB disk
    assert os.listdir(small_disk) == []


def test_zero_retries_means_one_attempt(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTICRUN_CKPT_RETRIES", "0")
    assert storage_mod._retries_from_env() == 1
    monkeypatch.setattr(storage_mod, "RETRY_ATTEMPTS", 0)
    assert storage_mod.retry(lambda: 42, "answer") == 42
    calls = []

    def flaky():
        calls.append(1)
        raise TimeoutError("slow")

    with pytest.raises(CheckpointError, match="cannot poke"):
        storage_mod.retry(flaky, "poke")
    assert calls == [1]
    res = subprocess.run(
        [sys.executable, "-c", "import torch; from elasticrun.checkpoint import save, load; "
         f"save({{'w': torch.ones(2)}}, {str(tmp_path)!r}, 'x'); print(load({str(tmp_path)!r}).name)"],
        capture_output=True, text=True, env=child_env({"ELASTICRUN_CKPT_RETRIES": "0"}), timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "x", res.stderr
