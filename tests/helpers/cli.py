"""The ``elasticrun`` command run in the test's own process, through the console script's entry point."""

from __future__ import annotations

from typing import List, Tuple

import pytest

from elasticrun.cli.main import main


def exit_code(argv: List[str]) -> int:
    """Run ``elasticrun ARGV`` here; its exit code (0 when it returns)."""
    try:
        main(list(argv))
    except SystemExit as ended:
        return int(ended.code or 0)
    return 0


def run_main(argv: List[str], capsys: pytest.CaptureFixture[str]) -> Tuple[int, str, str]:
    """Run ``elasticrun ARGV`` here: (exit code, stdout, stderr)."""
    code = exit_code(argv)
    out, err = capsys.readouterr()
    return code, out, err
