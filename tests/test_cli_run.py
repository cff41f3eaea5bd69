"""Bad input to ``elasticrun [run]``: one clear line, a non-zero exit, no traceback, and quickly."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator, List

import pytest

from elasticrun.job.exitcodes import ExitCode
from elasticrun.store.client import EtcdStore
from elasticrun.store.server import EtcdServer, find_etcd_binary, free_port

from helpers.launch import ECHO, SCRIPTS, assert_one_line_error, node_ids, run_cli
from helpers.procs import Agent, wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes


@pytest.mark.parametrize(
    "args,needles,code",
    [
        (["--nnodes", "3:2", ECHO], ["--nnodes", "MIN (3) is larger than MAX (2)"], 2),
        (["--nnodes", "0", ECHO], ["--nnodes", "at least 1"], 2),
        (["--nnodes", "two", ECHO], ["--nnodes", "MIN:MAX"], 2),
        (["--nproc-per-node", "0", ECHO], ["--nproc-per-node", "at least 1"], 2),
        (["--nproc-per-node", "many", ECHO], ["--nproc-per-node", "gpu, cpu, auto"], 2),
        (["--standalone", "no_such_script.py"], ["no_such_script.py", "not found"], 2),
        (["--standalone", "--no-python", "no-such-command-xyz"], ["no-such-command-xyz", "not found"], 2),
        (["--standalone", "--redirects", "7", ECHO], ["--redirects"], 2),
        (["--standalone", "--max-restarts", "-1", ECHO], ["--max-restarts"], 2),
        (["--standalone", "--heartbeat-timeout", "1", ECHO], ["--heartbeat-timeout", "at least 2"], 2),
        (["--standalone", "--rdzv-id", "bad/id", ECHO], ["--rdzv-id"], 2),
        (["--rdzv-endpoint", "localhost:notaport", ECHO], ["localhost:notaport", "host:port"], 2),  # usage (was 3)
        (["--standalone", str(SCRIPTS)], ["is a directory without __main__.py"], 2),
        (["--standalone", "--no-python", str(SCRIPTS / "echo_worker.py")], ["is not executable", "chmod +x"], 2),
        (["--standalone", "--no-python", str(SCRIPTS)], ["is a directory"], 2),
    ],
    ids=["min>max", "nnodes0", "nnodes-text", "nproc0", "nproc-text", "no-script", "no-command", "redirects",
         "max-restarts", "heartbeat", "rdzv-id", "endpoint-syntax", "dir-without-main", "not-executable",
         "command-is-dir"],
)
def test_bad_flags(args: List[str], needles: List[str], code: int) -> None:
    proc = run_cli(args, timeout=30)
    assert_one_line_error(proc, *needles)
    assert proc.returncode == code


@pytest.mark.parametrize("how", ["flag", "env"])
def test_unreachable_etcd_names_the_endpoint_and_how_to_start_one(how: str) -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    args = ["--rdzv-endpoint", endpoint, "--rdzv-id", "j", ECHO]
    env = {}
    if how == "flag":
        args = ["--etcd-timeout", "1", *args]
    else:
        env["ELASTICRUN_ETCD_TIMEOUT"] = "1"
    started = time.monotonic()
    proc = run_cli(args, timeout=30, env=env)
    took = time.monotonic() - started
    assert_one_line_error(proc, f"cannot reach etcd at {endpoint}", "elasticrun etcd", "--standalone")
    assert proc.returncode == ExitCode.TRANSIENT == 138  # retryable: etcd may come up
    assert took < 8, f"--etcd-timeout 1 should give up after about a second, took {took:.1f}s"


def _agent_args(endpoint: str, job: str, nproc: str = "2", *script_args: str) -> List[str]:
    return ["--nnodes", "2", "--nproc-per-node", nproc, "--rdzv-endpoint", endpoint, "--rdzv-id", job,
            "--etcd-timeout", "5", ECHO, *script_args]


@pytest.fixture
def waiting_agent(
    agents: Callable[..., Agent], etcd_server: EtcdServer, etcd: EtcdStore, job_id: str
) -> Iterator[Agent]:
    """The first node of a 2-node job (nproc 2, script args ``--lr 0.1``), registered and waiting."""
    agent = agents(_agent_args(etcd_server.endpoint, job_id, "2", "--lr", "0.1"), name="first")
    wait_until(lambda: len(node_ids(etcd, job_id)) == 1, 30, "the first node to register")
    yield agent
    agent.signal(15)
    agent.wait(30)


@pytest.mark.parametrize(
    "nproc,script_args,needle",
    [("1", ["--lr", "0.1"], "nproc_per_node: job has 2, this node has 1"),
     ("2", ["--lr", "0.2"], "args: job has ['--lr', '0.1'], this node has ['--lr', '0.2']")],
    ids=["nproc", "script-args"],
)
def test_node_with_different_settings_is_refused(
    nproc: str, script_args: List[str], needle: str, waiting_agent: Agent, etcd_server: EtcdServer,
    etcd: EtcdStore, job_id: str,
) -> None:
    proc = run_cli(_agent_args(etcd_server.endpoint, job_id, nproc, *script_args), timeout=60)
    line = assert_one_line_error(proc, f"job {job_id!r} runs with different settings", needle)
    assert "same flags" in line
    assert proc.returncode == 2
    # The refused node left no trace; the first node still waits for a proper partner.
    assert len(node_ids(etcd, job_id)) == 1 and waiting_agent.proc.poll() is None


@pytest.fixture(scope="module")
def secured_etcd() -> Iterator[EtcdServer]:
    """A separate etcd with a root user and authentication enabled."""
    server = EtcdServer().start()
    etcdctl = os.path.join(os.path.dirname(find_etcd_binary()), "etcdctl")
    try:
        for cmd in (["user", "add", "root:pw"], ["auth", "enable"]):
            done = subprocess.run([etcdctl, "--endpoints", server.endpoint, *cmd], capture_output=True, text=True,
                                  timeout=30)
            assert done.returncode == 0, done.stdout + done.stderr
        yield server
    finally:
        server.stop()


def test_secured_etcd_without_credentials(secured_etcd: EtcdServer) -> None:
    proc = run_cli(["--rdzv-endpoint", secured_etcd.endpoint, "--rdzv-id", "j", ECHO], timeout=60)
    assert_one_line_error(proc, secured_etcd.endpoint, "requires authentication", "--etcd-user", "--etcd-password")
    assert proc.returncode == ExitCode.USAGE  # refused credentials: no retry fixes them


def test_etcd_credentials_without_tls(secured_etcd: EtcdServer) -> None:
    """gRPC sends a user/password only over TLS: say so instead of failing obscurely."""
    proc = run_cli(
        ["--rdzv-endpoint", secured_etcd.endpoint, "--rdzv-id", "j", "--etcd-user", "root", "--etcd-password", "pw",
         ECHO],
        timeout=60,
    )
    assert_one_line_error(proc, "needs TLS", "--etcd-cacert")
    assert proc.returncode == ExitCode.USAGE


def test_help_lists_every_flag_documented_in_docs_cli() -> None:
    """docs/cli.md documents every flag of ``elasticrun run`` and ``elasticrun etcd``."""
    doc = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    for cmd in (["run", "--help"], ["etcd", "--help"]):
        proc = run_cli(cmd, timeout=30, env={"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"})
        assert proc.returncode == 0, proc.stderr
        flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])", proc.stdout)) - {"--help"}
        assert flags, proc.stdout
        missing = sorted(f for f in flags if not re.search(rf"`{re.escape(f)}(?![\w-])", doc))
        assert not missing, f"docs/cli.md lacks {missing}"


@pytest.mark.parametrize("argv", [["--help"], ["-h"], []], ids=["--help", "-h", "no-args"])
def test_top_level_help_shows_the_launcher_flags_then_the_commands(argv: List[str]) -> None:
    """A torchrun user types ``elasticrun --help``: the launcher's flags come first, the sub-commands after."""
    proc = run_cli(argv, timeout=30, env={"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"})
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert text.startswith("Usage: elasticrun [run] [OPTIONS] SCRIPT"), text[:200]
    flags = [text.index(f) for f in ("--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--max-restarts")]
    commands = text.index("\nCommands")
    assert max(flags) < commands, "the launcher's flags must come before the sub-commands"
    listed = re.findall(r"^  (\w+) +\S", text[commands:], re.M)
    assert set(listed) >= {"run", "status", "etcd", "ckpt"}, text[commands:]
