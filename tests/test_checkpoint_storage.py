"""fsspec storage, transient-error retries with backoff, and rollback of failed saves."""

from __future__ import annotations

import errno
import os
import uuid

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from elasticrun.checkpoint import CheckpointError, delete, list_checkpoints, load, save, verify
from elasticrun.checkpoint import storage as storage_mod


@pytest.fixture
def mem_root():
    root = f"memory://ckpt-test-{uuid.uuid4().hex[:8]}"
    yield root
    fs = MemoryFileSystem()
    path = root[len("memory://"):]
    if fs.exists(path):
        fs.rm(path, recursive=True)


def test_memory_filesystem_round_trip(mem_root):
    state = {"w": torch.randn(64, 33), "h": torch.arange(5).bfloat16(), "s": torch.tensor(1), "meta": {"x": 1}}
    save(state, mem_root, "a", training_state={"step": 1})
    save(state, mem_root, "b", training_state={"step": 2}, keep_last=1)
    infos = list_checkpoints(mem_root)
    assert [(i.name, i.status, i.latest) for i in infos] == [("b", "complete", True)]
    assert verify(mem_root, "b").ok
    res = load(mem_root)
    assert res.name == "b" and torch.equal(res.state_dict["w"], state["w"]) and res.state_dict["meta"] == {"x": 1}
    assert torch.equal(res.state_dict["h"], state["h"])
    with pytest.raises(CheckpointError, match="no complete checkpoint would be left"):
        delete(mem_root, ["b"])
    assert delete(mem_root, ["b"], force=True) == ["b"] and list_checkpoints(mem_root) == []


class Flaky:
    """Make the first ``n`` shard opens fail with ``exc``."""

    def __init__(self, monkeypatch, cls, n, exc):
        self.calls = 0
        orig = cls.open_write

        def open_write(inner, path):
            if path.endswith(".safetensors"):
                self.calls += 1
                if self.calls <= n:
                    raise exc
            return orig(inner, path)

        monkeypatch.setattr(cls, "open_write", open_write)


def test_transient_errors_are_retried(tmp_path, monkeypatch, mem_root):
    flaky = Flaky(monkeypatch, storage_mod.LocalStorage, 2, OSError(errno.ETIMEDOUT, "Connection timed out"))
    assert save({"a": torch.ones(3)}, tmp_path, "ok") == "ok"
    assert flaky.calls == 3 and torch.equal(load(tmp_path, "ok").state_dict["a"], torch.ones(3))
    flaky = Flaky(monkeypatch, storage_mod.FsspecStorage, 1, TimeoutError("read timed out"))
    assert save({"a": torch.ones(3)}, mem_root, "ok") == "ok" and flaky.calls == 2


def test_persistent_failure_rolls_back(tmp_path, monkeypatch):
    save({"a": torch.zeros(3)}, tmp_path, "before")
    monkeypatch.setattr(storage_mod, "RETRY_ATTEMPTS", 3)
    flaky = Flaky(monkeypatch, storage_mod.LocalStorage, 99, OSError(errno.EAGAIN, "Resource temporarily unavailable"))
    with pytest.raises(CheckpointError, match=r"saving checkpoint 'x' failed: cannot write .* after 3 attempts.*"
                                              r"temporary files were removed"):
        save({"a": torch.ones(3)}, tmp_path, "x")
    assert flaky.calls == 3
    assert sorted(os.listdir(tmp_path)) == ["before"]  # rolled back: no temporary directory left


def test_non_transient_failure_is_not_retried(tmp_path, monkeypatch):
    flaky = Flaky(monkeypatch, storage_mod.LocalStorage, 99, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(CheckpointError, match=r"No space left on device \(ENOSPC\)"):
        save({"a": torch.ones(3)}, tmp_path, "x")
    # not the transient-retry loop: one attempt, then (a full disk) one retry after making room
    assert flaky.calls == 2 and os.listdir(tmp_path) == []


def test_commit_failure_rolls_back(tmp_path, monkeypatch):
    def boom(self, src, dst):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(storage_mod.LocalStorage, "rename_dir", boom)
    with pytest.raises(CheckpointError, match="committing checkpoint 'x' failed.*Permission denied"):
        save({"a": torch.ones(3)}, tmp_path, "x")
    assert os.listdir(tmp_path) == []
