"""``elasticrun ckpt load --out``: Hugging Face safetensors exports (one file, or shards + index), real files."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import typer
from safetensors import safe_open
from safetensors.torch import load_file

from elasticrun.checkpoint import Shard, load, save
from elasticrun.checkpoint.export import split_shards
from elasticrun.cli import values
from elasticrun.cli.main import main

from helpers.ckpt import cli


@pytest.fixture
def ckpt(capsys: pytest.CaptureFixture[str]):
    """``elasticrun ckpt ARGS`` in-process (no torch import per call): a CompletedProcess-like result."""

    def call(*args: str) -> SimpleNamespace:
        code = 0
        try:
            main(["ckpt", *args])
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)

    return call


def _one_line_error(res, *fragments: str) -> str:
    assert res.returncode != 0, (res.stdout, res.stderr)
    assert "Traceback" not in res.stdout + res.stderr, res.stderr
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("elasticrun: error: "), res.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A checkpoint of a nested state dict: model.embed.weight (4000 B), model.layers.{0,1}.w (400 B each),
    model.head.bias (40 B), plus an optimizer tensor and a plain value."""
    g = torch.Generator().manual_seed(1)
    state = {
        "model": {"embed.weight": torch.randn(100, 10, generator=g),
                  "layers": {str(i): {"w": torch.randn(10, 10, generator=g)} for i in range(2)},
                  "head.bias": torch.randn(10, generator=g)},
        "optim": {"m": torch.zeros(3)},
        "step": 3,
    }
    r = tmp_path / "ckpts"
    save(state, r, name="final", training_state={"step": 3}, placements={"model.embed.weight": Shard(0)})
    return r


@pytest.mark.integration
def test_single_file_has_format_pt_and_dotted_names(root: Path, tmp_path: Path, ckpt) -> None:
    out = tmp_path / "model.safetensors"
    res = ckpt("load", str(root), "final", "--out", str(out), "--only", "model.", "--strip-prefix")
    assert res.returncode == 0, res.stderr
    tensors = load_file(str(out))
    assert sorted(tensors) == ["embed.weight", "head.bias", "layers.0.w", "layers.1.w"]
    original = load(root, "final").state_dict["model"]
    assert torch.equal(tensors["layers.1.w"], original["layers"]["1"]["w"])
    assert torch.equal(tensors["embed.weight"], original["embed.weight"])
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["format"] == "pt"  # transformers' from_pretrained requires it

    # never over an existing file without --force
    before = out.read_bytes()
    _one_line_error(cli("load", str(root), "final", "--out", str(out)), "already exists", "--force")
    assert out.read_bytes() == before
    res = ckpt("load", str(root), "final", "--out", str(out), "--force")
    assert res.returncode == 0, res.stderr
    assert "optim.m" in load_file(str(out))

    # never over the checkpoint's own files, --force or not
    shard = next((root / "final").glob("*.safetensors"))
    before = shard.read_bytes()
    _one_line_error(ckpt("load", str(root), "final", "--out", str(shard), "--force"), "inside the checkpoint")
    assert shard.read_bytes() == before


def test_sharded_export_matches_hugging_face(root: Path, tmp_path: Path, ckpt) -> None:
    out = tmp_path / "hf"
    res = ckpt("load", str(root), "final", "--out", str(out), "--only", "model.", "--strip-prefix",
              "--max-shard-size", "1KB")  # 1000 bytes: embed.weight alone, the rest together
    assert res.returncode == 0, res.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    weight_map = index["weight_map"]
    files = sorted(set(weight_map.values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == [*files, "model.safetensors.index.json"]
    total = 0
    for name in files:
        tensors = load_file(str(out / name))
        assert sorted(tensors) == sorted(k for k, f in weight_map.items() if f == name)  # each tensor where mapped
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        with safe_open(str(out / name), framework="pt") as f:
            assert f.metadata()["format"] == "pt"
    assert sorted(weight_map) == ["embed.weight", "head.bias", "layers.0.w", "layers.1.w"]
    assert weight_map["embed.weight"] != weight_map["layers.0.w"] == weight_map["layers.1.w"]
    assert index["metadata"]["total_size"] == total == 4000 + 400 + 400 + 40

    # refuses to overwrite; --force with a larger limit replaces the shards by one model.safetensors
    _one_line_error(ckpt("load", str(root), "final", "--out", str(out), "--max-shard-size", "1KB"), "--force")
    res = ckpt("load", str(root), "final", "--out", str(out), "--force")  # default limit 5GB: one file
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_bad_sizes_and_names_are_one_line(root: Path, tmp_path: Path, ckpt) -> None:
    _one_line_error(ckpt("load", str(root), "final", "--out", str(tmp_path / "d"), "--max-shard-size", "lots"),
                    "--max-shard-size")
    _one_line_error(ckpt("load", str(root), "final", "--out", str(tmp_path / "m.safetensors"), "--max-shard-size",
                        "1GB"), "directory")
    _one_line_error(ckpt("load", str(root), "final", "--out", str(tmp_path / "m.bin")), ".safetensors")


def test_split_and_sizes_follow_hugging_face() -> None:
    max_shard_size = values.size()  # what --max-shard-size reads its value with
    assert max_shard_size("5GB") == 5 * 10**9 and max_shard_size("2GiB") == 2 * 2**30
    assert max_shard_size("500MB") == 500 * 10**6 and max_shard_size("1000") == 1000
    for bad in ("-1", "0"):
        with pytest.raises(typer.BadParameter):
            max_shard_size(bad)
    sizes = [("a", 6), ("b", 3), ("c", 20), ("d", 4), ("e", 1)]
    assert split_shards(sizes, 10) == [["c"], ["a", "b"], ["d", "e"]]  # an oversized tensor is placed at once
    assert split_shards(sizes, 100) == [["a", "b", "c", "d", "e"]]
