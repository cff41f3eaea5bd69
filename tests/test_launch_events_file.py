"""``--events-file`` in a shared place: created 0600, never through a symbolic link, never into a
file of another user or something that is not a regular file; a refusal is one line and exit 2,
and the file the link points to is left as it was."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from helpers.launch import assert_one_line_error, run_cli
from helpers.procs import SCRIPTS

pytestmark = pytest.mark.integration  # starts etcd or processes


def _run(path: Path) -> subprocess.CompletedProcess:
    return run_cli(["--standalone", "--nproc-per-node", "1", "--events-file", str(path),
                    str(SCRIPTS / "echo_worker.py")], timeout=120)


def test_the_events_file_is_created_0600_even_with_a_permissive_umask(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    old = os.umask(0o000)
    try:
        proc = _run(path)
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text().splitlines()[-1])["event"] == "job_ended"


def test_a_symbolic_link_at_the_path_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("precious\n")
    link = tmp_path / "events.jsonl"
    link.symlink_to(target)
    proc = _run(link)
    assert proc.returncode == 2
    assert_one_line_error(proc, f"--events-file {str(link)!r} is a symbolic link")
    assert target.read_text() == "precious\n"
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "would-be-created")
    proc = _run(dangling)
    assert proc.returncode == 2 and not (tmp_path / "would-be-created").exists()
    assert_one_line_error(proc, "is a symbolic link")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user needs root")
def test_a_file_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "events.jsonl"
    theirs.write_text("theirs\n")
    os.chown(theirs, 65534, 65534)
    proc = _run(theirs)
    assert proc.returncode == 2
    assert_one_line_error(proc, "belongs to another user (uid 65534)")
    assert theirs.read_text() == "theirs\n"


def test_something_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader waiting: the open itself would succeed
    try:
        proc = _run(fifo)
    finally:
        os.close(reader)
    assert proc.returncode == 2
    assert_one_line_error(proc, "is not a regular file")
