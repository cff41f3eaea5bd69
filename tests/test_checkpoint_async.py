"""Async saves in one process: snapshot semantics, waiting, errors surfacing, retention."""

from __future__ import annotations

import errno

import pytest
import torch

from elasticrun.checkpoint import AsyncCheckpointer, CheckpointError, list_checkpoints, load
from elasticrun.checkpoint import storage as storage_mod


def test_snapshot_then_background_commit_with_retention(tmp_path):
    w = torch.zeros(256, 256)
    with AsyncCheckpointer() as ckpt:
        handles = []
        for step in range(1, 6):
            w.fill_(step)
            handles.append(ckpt.save({"w": w, "step": step}, tmp_path, training_state={"step": step}, keep_last=2))
            w.fill_(-1)  # the snapshot was taken: this must not reach the checkpoint
        assert handles[-1].result(timeout=60) == "step-00000005"
    assert all(h.done() for h in handles)
    infos = list_checkpoints(tmp_path)
    assert [(i.name, i.status) for i in infos] == [("step-00000004", "complete"), ("step-00000005", "complete")]
    for step in (4, 5):
        res = load(tmp_path, f"step-{step:08d}")
        assert torch.all(res.state_dict["w"] == step) and res.state_dict["step"] == step


def test_background_error_surfaces_on_next_call(tmp_path, monkeypatch):
    ckpt = AsyncCheckpointer()
    real_open = storage_mod.LocalStorage.open_write

    def failing_open(self, path):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(storage_mod.LocalStorage, "open_write", failing_open)
    handle = ckpt.save({"a": torch.ones(2)}, tmp_path, "bad")
    with pytest.raises(CheckpointError, match="Read-only file system"):
        handle.result(timeout=60)
    monkeypatch.setattr(storage_mod.LocalStorage, "open_write", real_open)
    with pytest.raises(CheckpointError, match="background save of 'bad' failed.*Read-only file system"):
        ckpt.save({"a": torch.ones(2)}, tmp_path, "good")  # the error is raised once, here
    ckpt.save({"a": torch.ones(2)}, tmp_path, "good")
    assert ckpt.wait() == "good"
    ckpt.close()
    assert [i.name for i in list_checkpoints(tmp_path)] == ["good"]  # "bad" was rolled back
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save({"a": torch.ones(2)}, tmp_path, "again")
