"""``--duplicate-*-filters``' line copy (``elasticrun.launch.logfilter``): lines cut like Python's text mode, matched
like torchrun's filter, from the ranks torchrun copies."""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from elasticrun.cli.run_values import line_filters
from elasticrun.launch.config import LaunchConfig, LogsConfig, WorkersConfig
from elasticrun.launch.logfilter import FilteredCopy, copied, open_filtered, unfed_warnings


def _copy(tmp_path: Path, needles: List[str], *chunks: bytes, prefix: str = "[n/0]:") -> str:
    copy = FilteredCopy(str(tmp_path / "attempt_0" / "filtered_stdout.log"), needles)
    feeder = copy.feeder(prefix)
    for chunk in chunks:
        feeder.feed(chunk)
    feeder.finish()
    copy.close()
    return (tmp_path / "attempt_0" / "filtered_stdout.log").read_text()


def test_lines_end_at_newlines_and_carriage_returns_even_across_chunks(tmp_path: Path) -> None:
    text = _copy(tmp_path, ["x"], b"x1\nx2\r", b"\nx3\rx", b"4\r\n", b"no\nx5 no newline")
    assert text == "[n/0]:x1\n[n/0]:x2\n[n/0]:x3\n[n/0]:x4\n[n/0]:x5 no newline\n"


def test_a_filter_matches_anywhere_and_an_empty_one_matches_every_line(tmp_path: Path) -> None:
    assert _copy(tmp_path, ["pie", "kiwi"], b"apple pie\nbanana\nkiwis\n") == "[n/0]:apple pie\n[n/0]:kiwis\n"
    assert _copy(tmp_path, [""], b"a\n\nb\n", prefix="") == "a\n\nb\n"
    assert _copy(tmp_path, ["\u00e9t\u00e9"], "caf\u00e9 \u00e9t\u00e9\n".encode() + b"\xff\n") == \
        "[n/0]:caf\u00e9 \u00e9t\u00e9\n"


@pytest.mark.parametrize("text,want", [(None, []), ("apple,orange", ["apple", "orange"]), ("a,,b", ["a,b"]),
                                       ("", [""]), ("a,", ["a", ""]), (",,,,", [",,"])])
def test_filters_split_like_torchruns_comma_separated_list(text: str, want: List[str]) -> None:
    from torch.distributed.run import get_args_parser

    assert line_filters(text) == want
    if text is not None:  # torchrun's own parsing of the same value
        args = get_args_parser().parse_args(["--duplicate-stdout-filters", text, "x.py"])
        assert args.duplicate_stdout_filters == want


def test_torchrun_copies_tee_d_streams_of_ranks_on_the_console_only(tmp_path: Path) -> None:
    cfg = LaunchConfig(workers=WorkersConfig(entrypoint="x.py", nproc_per_node=3),
                       logs=LogsConfig(tee="0:3,1:1,2:3", local_ranks_filter=[0, 1], duplicate_stdout_filters=["a"],
                                       duplicate_stderr_filters=["b"]))
    assert [copied(cfg, r, 1) for r in range(3)] == [True, True, False], "rank 2 is off the console"
    assert [copied(cfg, r, 2) for r in range(3)] == [True, False, False], "rank 1 tees stdout only"
    assert unfed_warnings(cfg) == []
    files = open_filtered(cfg, str(tmp_path / "attempt_4"))
    assert sorted(p.name for p in (tmp_path / "attempt_4").iterdir()) == ["filtered_stderr.log",
                                                                          "filtered_stdout.log"]
    for copy in files.values():
        copy.close()
    quiet = LaunchConfig(workers=WorkersConfig(entrypoint="x.py", nproc_per_node=2),
                         logs=LogsConfig(duplicate_stdout_filters=["a"]))
    assert [copied(quiet, r, 1) for r in range(2)] == [False, False]
    assert unfed_warnings(quiet) == ["--duplicate-stdout-filters: no local rank's stdout is tee'd (--tee 1 or 3) "
                                     "and shown, so filtered_stdout.log stays empty (as under torchrun)"]
    assert open_filtered(LaunchConfig(workers=WorkersConfig(entrypoint="x.py")), str(tmp_path / "none")) == {}
    assert not (tmp_path / "none").exists()
