"""Worker output and failure reports, with real agents and real worker processes (no torch in workers).

Live pass-through of ``\\r`` progress, --log-dir layout per attempt, --local-ranks-filter,
standby-pool workers' ``__file__`` and tracebacks, failures without @record, oversized error files.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

import pytest

from elasticrun.launch.failures import (
    REPORT_MAX,
    WorkerFailure,
    bounded,
    exception_line,
    make_failure,
    stderr_tail,
)
from elasticrun.launch.logs import Console, DumpFilter, LineState, add_prefix, line_prefix, split_line_end

from helpers.launch import REPO, SCRIPTS, run_cli
from helpers.procs import wait_until, worker_env

pytestmark = pytest.mark.integration  # starts etcd or processes

WORKER = str(SCRIPTS / "output_worker.py")
REL_WORKER = os.path.relpath(WORKER, REPO)


class Reader:
    """Bytes of a pipe as they arrive (read on a thread), so a test can wait on partial lines."""

    def __init__(self, pipe) -> None:
        self.data = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, args=(pipe,), daemon=True)
        self._thread.start()

    def _run(self, pipe) -> None:
        fd = pipe.fileno()
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                return
            with self._lock:
                self.data += chunk

    def text(self) -> str:
        with self._lock:
            return self.data.decode(errors="replace")


def test_progress_without_newline_shows_before_the_next_write(tmp_path: Path) -> None:
    go = tmp_path / "go"
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticrun", "--standalone", "--node-id", "nodeP", "--nproc-per-node", "1", WORKER],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=str(REPO),
        env=worker_env({"OUT_MODE": "progress", "OUT_GO": str(go)}),
    )
    err = Reader(proc.stderr)
    out = Reader(proc.stdout)
    try:
        wait_until(lambda: "[nodeP/0]:step 3\r" in err.text(), 60, "the '\\r' progress line on the agent's stderr")
        assert "step 4" not in err.text()  # the worker is blocked until we create `go`
        go.touch()
        assert proc.wait(60) == 0, err.text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_until(lambda: "[nodeP/0]:step 4\n" in err.text(), 10, "the rest of the output")
    assert "step" not in out.text()


def _attempt_dirs(logs: Path, job: str) -> List[Path]:
    runs = list(logs.glob(f"{job}_*"))
    assert len(runs) == 1, list(logs.iterdir())
    return sorted(runs[0].glob("attempt_*"))


def test_log_dir_layout_filter_and_standby_workers_look_like_python(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc = run_cli(
        ["--standalone", "--rdzv-id", "outjob", "--node-id", "nodeW", "--nproc-per-node", "2", "--max-restarts", "1",
         "--local-ranks-filter", "1", "--log-dir", str(logs), REL_WORKER],
        env={"OUT_MODE": "whoami"}, timeout=120,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    # torchrun's layout: <log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/{stdout,stderr}.log
    attempts = _attempt_dirs(logs, "outjob")
    assert [a.name for a in attempts] == ["attempt_0", "attempt_1"]
    pooled = []
    for attempt in attempts:
        assert sorted(p.name for p in attempt.iterdir()) == ["0", "1"]
        for local in ("0", "1"):
            out = (attempt / local / "stdout.log").read_text()
            # __file__ absolute, argv[0] as given: exactly like `python tests/scripts/output_worker.py`
            assert f"file={WORKER} argv0={REL_WORKER}" in out, out
            pooled.append("pooled=True" in out)
    first_err = (attempts[0] / "0" / "stderr.log").read_text()
    assert "ValueError: whoami-err" in first_err
    assert "warm.py" not in first_err and "runpy" not in first_err, first_err
    assert first_err.startswith("Traceback (most recent call last):\n  File \"" + WORKER), first_err
    assert any(pooled), "no worker came from the standby pool"
    # --local-ranks-filter 1: only local rank 1 on the console; rank 0 only in its files.
    assert "[nodeW/1]:file=" in proc.stdout and "[nodeW/0]:" not in text, text
    # the failure summary names the exception, not advice about @record
    assert "ValueError: whoami-err" in proc.stderr and "decorate main" not in proc.stderr


def test_failure_summary_shows_the_exception_without_record(tmp_path: Path) -> None:
    proc = run_cli(["--standalone", "--nproc-per-node", "1", WORKER], env={"OUT_MODE": "boom", "COLUMNS": "60"})
    assert proc.returncode != 0
    summary = proc.stderr[proc.stderr.index("failed: "):]
    assert "RuntimeError: boom-xyz" in summary and "about to fail" in summary, proc.stderr
    assert "decorate" not in proc.stderr
    # not a terminal: the table is not squeezed into 60 (or 80) columns
    assert any("RuntimeError: boom-xyz (exited with code 1)" in ln for ln in summary.splitlines()), summary


def test_failure_summary_shows_gloo_errors_verbatim(tmp_path: Path) -> None:
    """Worker text with brackets (gloo's ``[/path.cc:78]``, ``[rank0]:``) is shown as written, never as markup."""
    proc = run_cli(["--standalone", "--nproc-per-node", "1", WORKER], env={"OUT_MODE": "gloo"})
    assert proc.returncode != 0
    assert "MarkupError" not in proc.stderr, proc.stderr
    summary = proc.stderr[proc.stderr.index("failed: "):]
    gloo = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out"
    assert gloo in summary, summary
    assert "for recv operation to complete [/red]" in summary, summary
    assert "[rank0]: about to fail [bold]" in summary, summary


def test_huge_error_file_does_not_break_the_restart(tmp_path: Path) -> None:
    proc = run_cli(["--standalone", "--nproc-per-node", "1", "--max-restarts", "1", WORKER],
                   env={"OUT_MODE": "bigerror"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "round 1" in proc.stderr


# -- units -------------------------------------------------------------------------------------


def test_root_cause_table_and_errors_show_bracketed_text_verbatim() -> None:
    from rich.console import Console

    from elasticrun.launch.failures import root_cause_table

    text = "[rank1]: RuntimeError: [/x/unbound_buffer.cc:78] Timed out [/] [bold]not bold[/bold] \\"
    row = {"node_id": "[n1]", "host": "h", "rank": 1, "local_rank": 1, "exitcode": 1, "signal": None,
           "message": text, "traceback": "", "stderr_tail": "[rank1]: last [/red] line"}
    console = Console(width=400, record=True, file=open(os.devnull, "w"))
    console.print(root_cause_table([row], "job [x] failed"))
    shown = console.export_text()
    assert text in shown and "[rank1]: last [/red] line" in shown and "[n1] (root cause)" in shown, shown
    assert "job [x] failed" in shown, shown
    code = "from elasticrun.cli.console import fail; fail('bad [/] value [bold]x[/bold]', 7)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7, proc.stderr
    assert proc.stderr.strip() == "elasticrun: error: bad [/] value [bold]x[/bold]", proc.stderr


def test_prefix_goes_after_newlines_and_carriage_returns() -> None:
    out, state = add_prefix(b"a\rb\nc", b"[p]:", LineState.START)
    assert (out, state) == (b"[p]:a\r[p]:b\n[p]:c", LineState.MID)
    out, state = add_prefix(b"d\r", b"[p]:", state)
    assert (out, state) == (b"d\r", LineState.AFTER_CR)
    out, state = add_prefix(b"\ne", b"[p]:", state)  # \r\n split across chunks: no prefix before \n
    assert out == b"\n[p]:e"
    assert add_prefix(b"x\n", b"", LineState.MID) == (b"x\n", LineState.START)


def test_empty_lines_keep_their_prefix_as_under_torchrun() -> None:
    """``print("a"); print(); print("b")`` shows three prefixed lines, also when the empty line
    arrives in a chunk of its own or as a CRLF; a \r\n pair never makes an empty line."""
    out, state = add_prefix(b"a\n\nb\n", b"[p]:", LineState.START)
    assert out == b"[p]:a\n[p]:\n[p]:b\n"
    out, state = add_prefix(b"\n", b"[p]:", state)
    assert (out, state) == (b"[p]:\n", LineState.START)
    assert add_prefix(b"\r\n", b"[p]:", state)[0] == b"[p]:\r\n"
    assert add_prefix(b"x\r\ny\n", b"[p]:", LineState.START)[0] == b"[p]:x\r\n[p]:y\n"
    assert add_prefix(b"\n", b"[p]:", LineState.START)[0] == b"[p]:\n"  # the stream starts with an empty line


def test_stack_dumps_reach_the_console_without_elasticruns_own_frames() -> None:
    import elasticrun.launch.logs as logs

    pkg = Path(logs.__file__).resolve().parent.parent
    dump = (
        "Current thread 0x00007f00 (most recent call first):\n"
        '  File "/job/train.py", line 19 in stuck_here\n'
        '  File "/job/train.py", line 42 in <module>\n'
        f'  File "{pkg}/launch/warm.py", line 132 in _run_script\n'
        '  File "<frozen runpy>", line 88 in _run_code\n'
    ).encode()
    traceback = f'Traceback (most recent call last):\n  File "{pkg}/launch/warm.py", line 132 in x\n'.encode()
    f = DumpFilter()
    assert f(b"step 1\n") == b"step 1\n"
    out = f(dump[:90]) + f(dump[90:]) + f(b"\n") + f(b"after the dump\n") + f(traceback)
    assert b"stuck_here" in out and b"<module>" in out and b"after the dump" in out
    assert b"warm.py\", line 132 in _run_script" not in out and b"runpy" not in out, out
    assert out.endswith(traceback), "a traceback is not a dump: shown whole"


def test_a_line_cut_by_another_workers_text_continues_with_its_prefix() -> None:
    """A chunk boundary in mid-line while another worker writes: the continuation is prefixed again."""
    buf = io.BytesIO()
    console = Console(buf)  # type: ignore[arg-type]
    a, b = object(), object()
    out, start = add_prefix(b"hel", b"[a]:", LineState.START)
    console.write(a, out, False, False, b"[a]:")
    console.write(b, b"[b]:one\n", True, False, b"[b]:")
    out, start = add_prefix(b"lo\nnext", b"[a]:", start)
    console.write(a, out, False, True, b"[a]:")
    console.write(a, b"\n", True, True, b"[a]:")
    console.write(b, b"[b]:", False, False, b"[b]:")
    console.write(a, b"[a]:x\n", True, False, b"[a]:")
    console.write(b, b"\n", True, True, b"[b]:")  # its line was ended for it: no empty line
    assert buf.getvalue() == b"[a]:hel\n[b]:one\n[a]:lo\n[a]:next\n[b]:\n[a]:x\n"
    assert split_line_end(b"a\nb\rc") == (b"a\nb\r", b"c")
    assert split_line_end(b"abc") == (b"", b"abc")


def test_four_ranks_printing_at_once_keep_every_line_whole(tmp_path: Path) -> None:
    n = 300
    proc = run_cli(["--standalone", "--node-id", "nodeL", "--nproc-per-node", "4", REL_WORKER],
                   env={"OUT_MODE": "many", "OUT_LINES": str(n)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = re.compile(r"\[nodeL/(\d)\]:rank=(\d) line=(\d+) x{40}")
    seen = set()
    for text in proc.stdout.splitlines():
        m = line.fullmatch(text)
        assert m is not None and m[1] == m[2], f"a cut or unprefixed line: {text!r}"
        seen.add((int(m[2]), int(m[3])))
    assert seen == {(r, i) for r in range(4) for i in range(n)}


def test_prefix_template_follows_torchrun() -> None:
    assert line_prefix("n1", 5, 1, "trainer", {}) == "[n1/5]:"
    env = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[${role_name}${local_rank}]:"}
    assert line_prefix("n1", 5, 1, "trainer", env) == "[trainer1]:"
    assert line_prefix("n1", 5, 1, "trainer", {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": ""}) == ""


def test_exception_line_and_tail() -> None:
    err = "noise\nTraceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n" \
          "    f()\n    ^^^\nKeyError: 'k'\nexit noise\n"
    assert exception_line(err) == "KeyError: 'k'"
    assert exception_line("no traceback here") == ""
    tail = stderr_tail(("\n".join(f"l{i}" for i in range(100)) + "\nbar 1%\rbar 99%\n").encode())
    assert tail.splitlines()[-1] == "bar 99%" and len(tail.splitlines()) == 20
    assert len(stderr_tail(b"y" * 100_000).encode()) <= 4096


def test_reports_fit_in_etcd(tmp_path: Path) -> None:
    big = tmp_path / "error.json"
    big.write_text(json.dumps({"message": {"message": "E: " + "m" * 3_000_000,
                                           "extraInfo": {"py_callstack": "t" * 3_000_000, "timestamp": "1"}}}))
    failures = [make_failure("n", "h", r, r, 1, str(big), b"s" * 50_000) for r in range(64)]
    kept = bounded(failures)
    assert len(json.dumps([f.to_dict() for f in kept])) <= REPORT_MAX
    assert kept[0].message.startswith("E: mmm") and kept[0].traceback.endswith("ttt")
    assert len(kept) < 64 and "more failed workers" in kept[-1].message
    few = [WorkerFailure("n", "h", 0, 0, 1, None, "m", "tb", time.time())]
    assert bounded(few) == few
