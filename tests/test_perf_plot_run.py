"""scripts/perf/plot_job.py metrics: reads examples/train.py's metrics log, finds the rescales, draws a PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.scripts import load_script


def _load():
    return load_script("perf/plot_job.py")


def _log(path: Path, worlds) -> Path:
    with open(path, "w") as f:
        for step, world in enumerate(worlds, 1):
            f.write(json.dumps({"time": 100.0 + step, "step": step, "epoch": 0, "round": 0, "world": world,
                                "lr": 0.05 * world, "global_batch": 32 * world, "loss": 1.0 / step,
                                "samples_per_s": 1000.0 * world}) + "\n")
    return path


def test_rescales_and_rollback(tmp_path):
    mod = _load()
    path = _log(tmp_path / "m.jsonl", [3, 3, 3, 2, 2, 3, 3])
    with open(path, "a") as f:  # step 7 trained again after a rollback: the later record wins
        f.write(json.dumps({"time": 200.0, "step": 7, "epoch": 0, "round": 3, "world": 3, "lr": 0.15,
                            "global_batch": 96, "loss": 0.5, "samples_per_s": 1.0}) + "\n")
    rows = mod.read_log(path)
    assert [r["step"] for r in rows] == list(range(1, 8)) and rows[-1]["loss"] == 0.5
    assert [(old, new) for _, old, new in mod.rescales(rows)] == [(3, 2), (2, 3)]
    assert mod.pauses(rows) == [(106.0, 200.0)], "the re-trained step 7 comes from a later round"


def test_draws_a_png_with_a_reference(tmp_path):
    pytest.importorskip("matplotlib")
    mod = _load()
    run = _log(tmp_path / "run.jsonl", [3] * 5 + [2] * 5 + [3] * 5)
    ref = _log(tmp_path / "ref.jsonl", [3] * 15)
    out = tmp_path / "run.png"
    assert mod.main(["metrics", str(run), "--reference", str(ref), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_bad_input_is_one_line(tmp_path):
    mod = _load()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\n')
    with pytest.raises(SystemExit, match="lacks time, world, lr"):
        mod.main(["metrics", str(bad)])
    with pytest.raises(SystemExit, match="cannot read .*missing.jsonl"):
        mod.main(["metrics", str(tmp_path / "missing.jsonl")])
