"""The exit-code table of docs/cli.md against what every command does, row by row.

Each row of the table (command, code) is either driven here, through the real command (in this
process through its entry point, or as a process where the process matters: the agent, the
etcd server, a prompt on a terminal), or named as covered by another test, which must exist.
A row without either fails, and so does a driven row whose command exits with another code
than the table says.
"""

from __future__ import annotations

import os
import pty
import re
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

import pytest
import torch

from elasticrun.checkpoint import save
from elasticrun.store.client import EtcdStore
from elasticrun.store.server import EtcdServer, free_port

from helpers.cli import exit_code
from helpers.launch import ECHO
from helpers.procs import REPO, wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

DOC = REPO / "docs" / "cli.md"
Row = Tuple[str, int]

# Rows another test drives (a real multi-node job, a signal to a running agent): (command, code) → test.
ELSEWHERE: Dict[Row, str] = {
    ("run", 0): "tests/test_launch_single.py::test_standalone_two_workers_get_the_torchrun_environment",
    ("run", 1): "tests/test_launch_restart.py::"
                "test_always_failing_worker_exhausts_restarts_and_every_agent_shows_the_root_cause",
    ("run", 143): "tests/test_launch_signals.py::test_signal_stops_workers_and_leaves_etcd",
    ("every command", 130): "tests/test_launch_signals.py::test_signal_stops_workers_and_leaves_etcd",
}


def documented() -> Set[Row]:
    """(command, code) of every row of the table under ``## Exit codes`` in docs/cli.md."""
    text = DOC.read_text()
    section = text[text.index("## Exit codes"):]
    section = section[:section.index("\n## ", 5)]
    rows = set()
    for command, code in re.findall(r"^\| ([^|]+?) \| `(\d+)` \|", section, re.M):
        rows.add((command.replace("`", "").strip(), int(code)))
    return rows


def elasticrun(*args: str, timeout: float = 90, env: Optional[Dict[str, str]] = None,
               stdin: Optional[int] = subprocess.DEVNULL) -> subprocess.CompletedProcess:
    full = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "elasticrun", *args], capture_output=True, text=True,
                          timeout=timeout, env=full, cwd=str(REPO), stdin=stdin)


def command(*args: str) -> int:
    return exit_code(list(args))


def unreachable() -> str:
    return f"127.0.0.1:{free_port()}"  # nothing listens there


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ckpts"
    save({"w": torch.arange(4.0)}, r, training_state={"step": 10})
    return r


def _job_with_state(etcd: EtcdStore, job: str, state: str) -> None:
    prefix = f"/elasticrun/{job}/"
    etcd.put_json(prefix + "config", {"nnodes": "1:1"})
    etcd.put_json(prefix + "state", {"state": state, "reason": "test", "round": 0, "time": time.time()})


@contextmanager
def _etcd_command(port: int) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-m", "elasticrun", "etcd", "--port", str(port), "--peer-port",
                             str(free_port())], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(REPO))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def _serving(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _delete_answering_no(root: Path) -> Tuple[int, str]:
    """``ckpt delete ROOT step-00000010`` on a terminal, answering ``n``."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "elasticrun", "ckpt", "delete", str(root), "step-00000010"],
                            stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
    os.close(slave)
    try:
        os.write(master, b"n\n")  # typed ahead: the terminal keeps it until the prompt reads it
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(master)
    return proc.returncode, out


# -- the rows ----------------------------------------------------------------------------------------


def every_command_2(**_: object) -> List[Tuple[str, int]]:
    return [(" ".join(a), command(*a)) for a in (
        ["--nnodes", "abc", ECHO], ["status", "--events", "x"],
        ["check", "--max-gpu-temp-c", "hot"], ["etcd", "--port", "70000"], ["ckpt", "list", "--x"],
        ["ckpt", "save", "--timeout", "nan", "--rdzv-endpoint", "h:1", "--rdzv-id", "j"])]


def run_2(**_: object) -> List[Tuple[str, int]]:
    return [("no such script", elasticrun("--standalone", "no_such_script.py").returncode)]


def run_138(**_: object) -> List[Tuple[str, int]]:
    return [("etcd unreachable", elasticrun("--rdzv-endpoint", unreachable(), "--rdzv-id", "j", "--etcd-timeout",
                                            "0.5", ECHO).returncode)]


def status_0(etcd_server: EtcdServer, etcd: EtcdStore, job_id: str, **_: object) -> List[Tuple[str, int]]:
    _job_with_state(etcd, job_id, "succeeded")
    ep = etcd_server.endpoint
    return [("one job", command("status", "--rdzv-endpoint", ep, "--rdzv-id", job_id)),
            ("the list", command("status", "--rdzv-endpoint", ep)),
            ("--watch, succeeded", command("status", "--rdzv-endpoint", ep, "--rdzv-id", job_id, "--watch",
                                              "--json"))]


def status_1(etcd_server: EtcdServer, etcd: EtcdStore, job_id: str, **_: object) -> List[Tuple[str, int]]:
    _job_with_state(etcd, job_id, "failed")
    return [("--watch, failed", command("status", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id,
                                           "--watch", "--json"))]


def status_2(etcd_server: EtcdServer, job_id: str, **_: object) -> List[Tuple[str, int]]:
    return [("no such job", command("status", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id",
                                       job_id + "-none"))]


def status_138(**_: object) -> List[Tuple[str, int]]:
    return [("etcd unreachable", command("status", "--rdzv-endpoint", unreachable(), "--timeout", "0.5"))]


def etcd_0(**_: object) -> List[Tuple[str, int]]:
    port = free_port()
    with _etcd_command(port) as proc:
        wait_until(lambda: _serving(port) or proc.poll() is not None, 60, "elasticrun etcd to serve")
        proc.send_signal(signal.SIGTERM)
        return [("SIGTERM", proc.wait(60))]


def etcd_1(tmp_path: Path, **_: object) -> List[Tuple[str, int]]:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return [("data dir it cannot use", elasticrun("etcd", "--port", str(free_port()), "--data-dir",
                                                  str(blocker / "data")).returncode)]


def etcd_2(**_: object) -> List[Tuple[str, int]]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        return [("port in use", elasticrun("etcd", "--port", str(taken.getsockname()[1])).returncode)]


def ckpt_read_0(root: Path, tmp_path: Path, **_: object) -> List[Tuple[str, int]]:
    return [(a[0], command("ckpt", *a)) for a in (
        ["list", str(root)], ["inspect", str(root)], ["verify", str(root)],
        ["load", str(root), "--out", str(tmp_path / "m.safetensors")])]


def ckpt_read_5(root: Path, tmp_path: Path, **_: object) -> List[Tuple[str, int]]:
    shard = next((root / "step-00000010").glob("shard-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-4] + b"\0\0\0\0")  # same size, other bytes: a checksum mismatch
    return [("list: no root", command("ckpt", "list", str(tmp_path / "none"))),
            ("inspect: no checkpoint", command("ckpt", "inspect", str(root), "step-00000099")),
            ("verify: corrupt", command("ckpt", "verify", str(root))),
            ("load: no checkpoint", command("ckpt", "load", str(root), "nope", "--out",
                                               str(tmp_path / "m.safetensors")))]


def ckpt_delete_0(root: Path, **_: object) -> List[Tuple[str, int]]:
    code, out = _delete_answering_no(root)
    assert "nothing deleted" in out and (root / "step-00000010").is_dir(), out
    return [("answered no", code)]


def ckpt_delete_2(root: Path, **_: object) -> List[Tuple[str, int]]:
    return [("no --yes off a terminal", command("ckpt", "delete", str(root), "step-00000010"))]


def ckpt_delete_5(root: Path, **_: object) -> List[Tuple[str, int]]:
    return [("unknown name", command("ckpt", "delete", str(root), "step-00000099", "--yes")),
            ("last complete one", command("ckpt", "delete", str(root), "step-00000010", "--yes"))]


def ckpt_save_0(tmp_path: Path, **_: object) -> List[Tuple[str, int]]:
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    return [("--from", command("ckpt", "save", "--from", str(tmp_path / "m.pt"), str(tmp_path / "r"), "imp"))]


def ckpt_save_2(etcd_server: EtcdServer, job_id: str, **_: object) -> List[Tuple[str, int]]:
    return [("no such job", command("ckpt", "save", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id",
                                       job_id + "-none"))]


def ckpt_save_5(etcd_server: EtcdServer, etcd: EtcdStore, job_id: str, **_: object) -> List[Tuple[str, int]]:
    _job_with_state(etcd, job_id, "succeeded")
    return [("the job has ended", command("ckpt", "save", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id",
                                             job_id))]


def ckpt_save_138(**_: object) -> List[Tuple[str, int]]:
    return [("etcd unreachable", command("ckpt", "save", "--rdzv-endpoint", unreachable(), "--rdzv-id", "j",
                                            "--etcd-timeout", "0.5"))]


def check_0(tmp_path: Path, **_: object) -> List[Tuple[str, int]]:
    return [("this machine", command("check", "--ckpt-dir", str(tmp_path), "--no-allreduce"))]


def check_6(tmp_path: Path, **_: object) -> List[Tuple[str, int]]:
    return [("a CPU below the threshold", command("check", "--ckpt-dir", str(tmp_path), "--no-allreduce",
                                                  "--min-cpu-gflops", "1e9")),
            ("etcd unreachable", command("check", "--ckpt-dir", str(tmp_path), "--no-allreduce", "--rdzv-endpoint",
                                         unreachable(), "--timeout", "0.5"))]


def run_6(tmp_path: Path, **_: object) -> List[Tuple[str, int]]:
    return [("node check failed", elasticrun("--standalone", "--node-check", "--node-check-thresholds",
                                             "min-cpu-gflops=1e9", ECHO, env={"ELASTICRUN_CHECKPOINT_DIR":
                                                                              str(tmp_path)}).returncode)]


CKPT_READ = "ckpt list, inspect, verify, load"
DRIVEN: Dict[Row, Callable[..., List[Tuple[str, int]]]] = {
    ("every command", 2): every_command_2,
    ("run", 2): run_2, ("run", 6): run_6, ("run", 138): run_138,
    ("check", 0): check_0, ("check", 6): check_6,
    ("status", 0): status_0, ("status", 1): status_1, ("status", 2): status_2, ("status", 138): status_138,
    ("etcd", 0): etcd_0, ("etcd", 1): etcd_1, ("etcd", 2): etcd_2,
    (CKPT_READ, 0): ckpt_read_0, (CKPT_READ, 5): ckpt_read_5,
    ("ckpt delete", 0): ckpt_delete_0, ("ckpt delete", 2): ckpt_delete_2, ("ckpt delete", 5): ckpt_delete_5,
    ("ckpt save", 0): ckpt_save_0, ("ckpt save", 2): ckpt_save_2, ("ckpt save", 5): ckpt_save_5,
    ("ckpt save", 138): ckpt_save_138,
}


def test_every_documented_row_is_driven_here_or_by_a_named_test() -> None:
    rows = documented()
    assert len(rows) >= 20, rows
    missing = sorted(rows - set(DRIVEN) - set(ELSEWHERE))
    assert not missing, f"rows of docs/cli.md's exit-code table that no test drives: {missing}"
    stale = sorted((set(DRIVEN) | set(ELSEWHERE)) - rows)
    assert not stale, f"driven rows that docs/cli.md does not have: {stale}"
    for row, where in ELSEWHERE.items():
        path, name = where.split("::")
        assert f"def {name}(" in (REPO / path).read_text(), f"{row}: {where} does not exist"


@pytest.mark.parametrize("row", sorted(DRIVEN), ids=[f"{c} {n}" for c, n in sorted(DRIVEN)])
def test_the_command_exits_as_documented(row: Row, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    fixtures = {"tmp_path": tmp_path}
    driver = DRIVEN[row]
    for name in driver.__code__.co_varnames[:driver.__code__.co_argcount + driver.__code__.co_kwonlyargcount]:
        if name not in fixtures:
            fixtures[name] = request.getfixturevalue(name)
    results = driver(**fixtures)
    assert results and all(code == row[1] for _, code in results), (row, results)
