"""``latest`` never passes over a damaged newer checkpoint without a word, ``verify ROOT`` checks every
checkpoint, and an offline reshard into a job's root is its newest checkpoint (docs/checkpoints.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from elasticrun.checkpoint import list_checkpoints, load, save

from helpers.cli import run_main as cli


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """step-200 and step-250 complete; then step-250's shard truncated (a disk that filled up, a bad copy)."""
    r = tmp_path / "ckpts"
    for step in (200, 250):
        save({"w": torch.full((64,), float(step))}, r, training_state={"step": step})
    shard = next((r / "step-00000250").glob("shard-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:50])
    return r


def test_verify_root_checks_every_checkpoint_and_fails_on_the_damaged_newest(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = cli(["ckpt", "verify", str(root)], capsys)
    assert code == 5, (out, err)
    assert "ok step-00000200" in out
    errors = [ln for ln in err.splitlines() if ln.startswith("elasticrun: error:")]
    assert len(errors) == 1 and "1 of 2 checkpoints failed" in errors[0] and "step-00000250" in errors[0], err
    assert "Traceback" not in err
    code, out, _ = cli(["ckpt", "verify", str(root), "--json"], capsys)
    doc = json.loads(out)
    assert code == 5 and doc["ok"] is False
    assert [(c["name"], c["ok"]) for c in doc["checkpoints"]] == [("step-00000200", True), ("step-00000250", False)]


def test_verify_latest_and_load_latest_name_the_checkpoint_they_skipped(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (["ckpt", "verify", str(root), "latest"], ["ckpt", "inspect", str(root)],
                 ["ckpt", "load", str(root), "--out", str(tmp_path / "m.safetensors")]):
        code, out, err = cli(argv, capsys)
        assert code == 0, err
        warning = [ln for ln in err.splitlines() if ln.startswith("elasticrun: warning: skipped step-00000250")]
        assert len(warning) == 1 and "truncated" in warning[0] and "using step-00000200" in warning[0], err
    assert torch.equal(load_file(str(tmp_path / "m.safetensors"))["w"], torch.full((64,), 200.0))


def test_latest_says_nothing_when_nothing_was_skipped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = tmp_path / "ok"
    save({"w": torch.zeros(2)}, r, training_state={"step": 1})
    (r / ".step-00000002.tmp-abc").mkdir()  # a save in progress is no damage
    code, out, err = cli(["ckpt", "verify", str(r), "latest"], capsys)
    assert code == 0 and err == "" and "ok step-00000001" in out


def test_an_offline_reshard_into_the_jobs_root_is_its_latest(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    r = tmp_path / "job"
    save({"w": torch.arange(8.0)}, r, training_state={"step": 300})
    code, _, err = cli(["ckpt", "load", str(r), "--world-size", "2", "--out", str(r), "--name", "step-300-w2"], capsys)
    assert code == 0, err
    latest = [i.name for i in list_checkpoints(str(r)) if i.latest]
    assert latest == ["step-300-w2"]
    assert load(r, "latest").world_size == 2


def test_deleting_the_last_checkpoint_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = tmp_path / "one"
    save({"w": torch.zeros(2)}, r, training_state={"step": 1})
    code, _, err = cli(["ckpt", "delete", str(r), "step-00000001", "--yes"], capsys)
    assert code == 5 and "pass --force if you mean it" in err and "force=True" not in err, err
