"""The job's contract package (elasticrun.job): one home for keys, env names and etcd settings."""

from __future__ import annotations

import ast
import os
import re
import stat
from pathlib import Path
from typing import Callable, List

import pytest

from elasticrun.errors import ConfigError
from elasticrun.job import env as names
from elasticrun.job.keys import ROOT, JobKeys, job_of
from elasticrun.job.settings import from_env, from_options, password_on_command_line, to_file
from elasticrun.launch.env import WorkerSpec, worker_env
from elasticrun.rendezvous.records import Member, Topology
from elasticrun.store.settings import EtcdSettings

PACKAGE = Path(__file__).resolve().parent.parent / "elasticrun"


def _docstring_ids(tree: ast.AST) -> set:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _literals_outside_job(matches: Callable[[str], bool]) -> List[str]:
    """Every string literal (docstrings aside) of elasticrun/ outside elasticrun/job/ that ``matches``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "job":
            continue
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstring_ids(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                    and matches(node.value):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}")
    return found


def test_no_module_outside_the_contract_builds_keys_or_env_names():
    """A string literal that is an etcd key (``/elasticrun/...`` not followed by a ``<placeholder>``
    in a message) or an ``ELASTICRUN_*`` name is allowed in elasticrun/job/ only."""
    offenders = _literals_outside_job(lambda text: bool(
        re.search(r"/elasticrun/(?!<)", text) or re.fullmatch(r"ELASTICRUN_[A-Z0-9_]*", text)))
    assert not offenders, "build keys and env names with elasticrun.job:\n" + "\n".join(offenders)


def test_the_shared_memory_layout_is_spelled_in_job_shm_only():
    """The snapshot directory's name and its subdirectories (``generations``, ``replicas``, ...)
    are spelled in elasticrun/job/shm.py only; everyone else uses its names."""
    offenders = _literals_outside_job(lambda text: bool(
        re.fullmatch(r"(generations|replicas|restore|outgoing|persist)/?", text) or "elasticrun-snap-" in text
        or text == "/dev/shm"))
    assert not offenders, "use elasticrun.job.shm for the shared-memory layout:\n" + "\n".join(offenders)


def test_key_layout():
    k = JobKeys("job42")
    assert k.prefix == ROOT + "job42/" and k.job_id == "job42" and k.job == "job42"
    assert k.checkpoint_request("r1") == "/elasticrun/job42/control/checkpoint/r1"
    assert k.checkpoint_answer("r1") == "/elasticrun/job42/control/checkpoint-done/r1"
    assert k.progress_of("n@h:1") == "/elasticrun/job42/progress/n@h:1"
    assert k.fence == k.topology == "/elasticrun/job42/topology"
    every = [k.config, k.state, k.topology, k.ping, k.node("a"), k.failed(3), k.failure(3, "a"), k.end(3),
             k.done(3, "a"), k.event(3), k.checkpoint_request("r"), k.checkpoint_answer("r"), k.progress_of("a")]
    assert all(key.startswith(k.prefix) and job_of(key) == "job42" for key in every), "one prefix per job"


def test_settings_file_is_private_and_round_trips(tmp_path: Path):
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    s = from_options("127.0.0.1:2379", user="u", password_file=str(pw), ca_cert=None)
    assert s.password == "s3cret" and "s3cret" not in repr(s)
    path = to_file(s, str(tmp_path / "etcd.json"))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    back = from_env({names.ETCD_SETTINGS_FILE: path, names.RDZV_ENDPOINT: "ignored:1"})
    assert back == s
    assert from_env({names.RDZV_ENDPOINT: "h:1"}) == EtcdSettings("h:1")
    assert from_env({}) is None


@pytest.mark.parametrize("kwargs, needle", [
    (dict(user="u"), "has no password"),
    (dict(user="u", password_file="/nonexistent/pw"), "cannot read the etcd password file"),
    (dict(password="p"), "without a user"),
    (dict(cert="/x.crt"), "both --etcd-cert and --etcd-key"),
    (dict(ca_cert="/nonexistent/ca.crt"), "--etcd-cacert"),
])
def test_bad_credentials_are_one_line_config_errors(kwargs, needle, monkeypatch):
    monkeypatch.delenv(names.ETCD_PASSWORD, raising=False)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        from_options("127.0.0.1:2379", **kwargs)


def test_password_flag_is_detected():
    assert password_on_command_line(["x", "--etcd-password", "p"])
    assert password_on_command_line(["x", "--etcd-password=p"])
    assert not password_on_command_line(["x", "--etcd-password-file", "f"])


def test_worker_env_drops_secrets_and_names_the_settings_file():
    topo = Topology(round=2, members=(Member("n", "h", "127.0.0.1", 1, 0, 0),), master_addr="127.0.0.1", master_port=1)
    spec = WorkerSpec(topo, topo.members[0], 0, "/e", "/ev")
    base = {names.ETCD_PASSWORD: "s3cret", "PATH": "/bin", names.ETCD_SETTINGS_FILE: "/stale"}
    env = worker_env(base, spec, run_id="j", max_restarts=0, rdzv_endpoint="h:1", node_id="n",
                     etcd_settings_file="/run/etcd.json")
    assert names.ETCD_PASSWORD not in env and "s3cret" not in env.values()
    assert env[names.ETCD_SETTINGS_FILE] == "/run/etcd.json" and env[names.RDZV_ID] == "j" and env["PATH"] == "/bin"
    env = worker_env(base, spec, run_id="j", max_restarts=0, rdzv_endpoint="h:1", node_id="n")
    assert names.ETCD_SETTINGS_FILE not in env
