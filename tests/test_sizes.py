"""One size rule for every flag and variable that takes a size: GB = 10⁹ bytes, GiB = 2³⁰.

Before, ``--max-shard-size 5GB`` meant 5·10⁹ bytes and ``--snapshot-memory 5GB`` 5·2³⁰.
Each flag is parsed here the way the CLI parses it; the worker-side variable
``ELASTICRUN_SNAPSHOT_MEMORY`` is covered in test_memory_snapshot.py (the cap message).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List

import pytest
import torch

from elasticrun.checkpoint import save
from elasticrun.cli.main import main
from elasticrun.cli.run_config import build_config
from elasticrun.cli.torchrun_args import parse
from elasticrun.errors import ConfigError
from elasticrun.sizes import format_size, parse_size


@pytest.mark.parametrize("text,size", [
    ("1000", 1000), ("0", 0), ("7B", 7), ("5GB", 5 * 10**9), ("5G", 5 * 10**9), ("5gb", 5 * 10**9),
    ("5GiB", 5 * 2**30), ("5Gi", 5 * 2**30), ("1.5GiB", 3 * 2**29), ("512MB", 512 * 10**6), ("512M", 512 * 10**6),
    ("512MiB", 512 << 20), ("2KiB", 2048), ("2K", 2000), ("1TB", 10**12), ("1TiB", 2**40), (" 3 MiB ", 3 << 20),
    ("123456789012345678901", 123456789012345678901),
])
def test_the_rule(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("size,text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (5 * 2**30, "5.0 GiB"), (2**40, "1.0 TiB"),
    (5 * 2**50, "5120.0 TiB"), (-2048, "-2.0 KiB"), (10**9, "953.7 MiB"),
])
def test_sizes_in_messages_are_binary_units(size: int, text: str) -> None:
    assert format_size(size) == text


@pytest.mark.parametrize("text", ["lots", "", "-1", "5XB", "5 G B", "GB", "1e9", "5iB", "5Gib2"])
def test_a_bad_size_is_one_line_that_says_how(text: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_size(text)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"not a size: {text!r}") and "5GB = 5·10⁹" in msg and "GiB" in msg


def _snapshot_memory(argv: List[str], env: Dict[str, str]) -> Any:
    return build_config(parse(["--standalone", *argv, "train.py"], env)).memory.snapshot_memory


def test_snapshot_memory_flag_and_variable_follow_the_rule() -> None:
    assert _snapshot_memory(["--snapshot-memory", "5GB"], {}) == 5 * 10**9  # was 5·2³⁰
    assert _snapshot_memory(["--snapshot-memory", "5GiB"], {}) == 5 * 2**30
    assert _snapshot_memory(["--snapshot-memory", "8G"], {}) == 8 * 10**9
    assert _snapshot_memory([], {"ELASTICRUN_SNAPSHOT_MEMORY": "2GB"}) == 2 * 10**9
    assert _snapshot_memory([], {}) is None
    with pytest.raises(ConfigError) as err:
        _snapshot_memory(["--snapshot-memory", "8 apples"], {})
    assert "\n" not in str(err.value) and "--snapshot-memory '8 apples': not a size" in str(err.value)


@pytest.fixture
def ckpt_root(tmp_path: Path) -> Path:
    save({"w": torch.arange(10.0)}, str(tmp_path / "ck"), "final")
    return tmp_path / "ck"


def _load(capsys: pytest.CaptureFixture[str], *args: str) -> SimpleNamespace:
    code = 0
    try:
        main(["ckpt", "load", *args])
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("2GiB", 2 * 2**30), ("1000", 1000), ("1K", 1000)])
def test_max_shard_size_flag_follows_the_rule(ckpt_root: Path, tmp_path: Path, text: str, size: int,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import elasticrun.checkpoint.consolidate as consolidate

    seen: Dict[str, Any] = {}
    monkeypatch.setattr(consolidate, "consolidate", lambda *a, **kw: seen.update(kw) or ["w"])
    res = _load(capsys, str(ckpt_root), "final", "--out", str(tmp_path / "hf"), "--max-shard-size", text)
    assert res.returncode == 0, res.stderr
    assert seen["max_shard_size"] == size


def test_bad_max_shard_size_is_one_line(ckpt_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = _load(capsys, str(ckpt_root), "final", "--out", str(tmp_path / "hf"), "--max-shard-size", "5 apples")
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert len(lines) == 1 and "--max-shard-size" in lines[0] and "'5 apples' is not a size" in lines[0], lines
    assert res.returncode == 2  # a bad flag
