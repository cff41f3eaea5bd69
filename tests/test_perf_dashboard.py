"""scripts/perf/plot_job.py dashboard: a scrapes file it cannot use is one line, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.scripts import load_script


def _load():
    return load_script("perf/plot_job.py")


def test_scrapes_it_cannot_use_are_one_line(tmp_path: Path) -> None:
    mod = _load()
    with pytest.raises(SystemExit, match=r"cannot read .*missing\.jsonl \(No such file or directory\)"):
        mod.read_scrapes(tmp_path / "missing.jsonl")
    with pytest.raises(SystemExit, match="cannot read .*Is a directory"):
        mod.read_scrapes(tmp_path)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"time": 1}\n')
    with pytest.raises(SystemExit, match=r"bad\.jsonl:1 is not a scrape"):
        mod.read_scrapes(bad)
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"time": t, "target": "h:1", "samples": {}}) + "\n" for t in (2.0, 1.0)))
    assert [r["time"] for r in mod.read_scrapes(good)] == [1.0, 2.0]
