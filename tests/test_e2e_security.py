"""A secured etcd end to end: TLS with client certificates, authentication, a user per job
limited to its own prefix, auth tokens that expire every few seconds, and an etcd restart.

Everything is real: the etcd process (certificates made by tests/helpers/tls.py), the
agents, examples/train.py workers on gloo, and the CLI as subprocesses.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Dict, Iterator, List

import psutil
import pytest

from elasticrun.errors import StoreError
from elasticrun.job import env as names
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.jobstatus import list_jobs
from elasticrun.rendezvous.view import JobView
from elasticrun.store.server import free_port
from elasticrun.store.settings import EtcdSettings

from helpers.launch import assert_one_line_error, run_cli, wait_agents
from helpers.procs import REPO, Agent, wait_until
from helpers.tls import ROOT_PASSWORD, Certs, SecureEtcd, start_secure_etcd

pytestmark = pytest.mark.integration  # starts etcd or processes

TOKEN_TTL = 2  # seconds an idle auth token stays valid (etcd --auth-token-ttl)
EXAMPLE = REPO / "examples" / "train.py"


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    etcd = start_secure_etcd(tmp_path_factory.mktemp("tls"), token_ttl=TOKEN_TTL)
    yield etcd
    etcd.server.stop()


def _job_user(secure: SecureEtcd, tmp_path: Path, prefix: str = "sec") -> tuple:
    """A new job id with its own user, and a 0600 file holding that user's password."""
    job = f"{prefix}-{uuid.uuid4().hex[:8]}"
    password = f"pw-{uuid.uuid4().hex}"
    secure.add_job_user(job, password)
    pw = tmp_path / f"{job}.pw"
    pw.write_text(password + "\n")
    pw.chmod(0o600)
    return job, password, pw


def _tls_flags(secure: SecureEtcd) -> List[str]:
    crt, key = secure.certs.client("elasticrun-client")
    return ["--etcd-cacert", str(secure.certs.ca), "--etcd-cert", str(crt), "--etcd-key", str(key)]


# -- least privilege ------------------------------------------------------------------------------


def test_a_job_user_reaches_its_own_keys_only(secure: SecureEtcd, tmp_path: Path):
    job_a, _, pw_a = _job_user(secure, tmp_path, "a")
    job_b, _, _ = _job_user(secure, tmp_path, "b")
    with secure.settings("root").connect() as root:
        root.put(JobKeys(job_b).config, "{}")
    settings_a = secure.settings(job_a, password_file=str(pw_a))
    with settings_a.connect(JobKeys(job_a).ping) as a:
        assert a.put(JobKeys(job_a).config, "{}") > 0 and a.get(JobKeys(job_a).config) is not None
        for attempt in (lambda: a.get(JobKeys(job_b).config), lambda: a.put(JobKeys(job_b).state, "x"),
                        lambda: a.get_prefix(JobKeys(job_b).prefix), lambda: a.delete(JobKeys(job_b).config),
                        lambda: a.get_prefix("/elasticrun/")):
            with pytest.raises(StoreError, match="denied user"):
                attempt()
        with pytest.raises(StoreError, match="may list nothing but its job: pass --rdzv-id"):
            list_jobs(a)  # `elasticrun status` without --rdzv-id
    with pytest.raises(StoreError, match="denied user"):
        settings_a.connect(JobKeys(job_b).ping)  # the access check at connect reads inside the job asked for
    with secure.settings("root").connect() as root:
        assert root.get(JobKeys(job_b).config).value == b"{}" and root.get(JobKeys(job_b).state) is None


def test_wrong_or_missing_credentials_fail_at_once_with_one_line(secure: SecureEtcd, tmp_path: Path):
    job, _, pw = _job_user(secure, tmp_path)
    wrong = tmp_path / "wrong.pw"
    wrong.write_text("not-the-password\n")
    base = ["status", "--rdzv-endpoint", secure.server.endpoint, "--rdzv-id", job, *_tls_flags(secure)]
    env = {names.ETCD_PASSWORD: None, names.ETCD_USER: None}
    t0 = time.monotonic()
    rejected = run_cli([*base, "--etcd-user", job, "--etcd-password-file", str(wrong)], env=env)
    assert_one_line_error(rejected, f"rejected user '{job}'", "wrong user name or password")
    assert rejected.returncode == 2, "a wrong password is permanent: not the retryable 138"
    assert_one_line_error(run_cli([*base, "--etcd-user", job], env=env), f"etcd user '{job}' has no password",
                          names.ETCD_PASSWORD, "--etcd-password-file")
    assert_one_line_error(run_cli([*base, "--etcd-user", job, "--etcd-password-file", str(tmp_path / "none")],
                                  env=env), "cannot read the etcd password file")
    assert_one_line_error(run_cli(base, env=env), "denied access to a client without --etcd-user")
    assert time.monotonic() - t0 < 40, "credential errors must not be retried like an outage"
    ok = run_cli([*base, "--etcd-user", job, "--etcd-password-file", str(pw), "--json"], env=env)
    assert_one_line_error(ok, f"no job '{job}'")  # in: the job has no keys yet


def test_password_on_the_command_line_draws_a_warning(secure: SecureEtcd, tmp_path: Path):
    job, password, _ = _job_user(secure, tmp_path)
    proc = run_cli(["status", "--rdzv-endpoint", secure.server.endpoint, "--rdzv-id", job, *_tls_flags(secure),
                    "--etcd-user", job, "--etcd-password", password], env={names.ETCD_PASSWORD: None})
    assert "--etcd-password is visible to every user" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_cli(["status", "--rdzv-endpoint", secure.server.endpoint, "--rdzv-id", job, *_tls_flags(secure),
                    "--etcd-user", job], env={names.ETCD_PASSWORD: password})
    assert "visible to every user" not in proc.stderr and "Traceback" not in proc.stderr


# -- tokens ---------------------------------------------------------------------------------------


def test_tokens_are_renewed_after_expiry_and_etcd_restart(secure: SecureEtcd, tmp_path: Path):
    job, _, pw = _job_user(secure, tmp_path)
    keys = JobKeys(job)
    events: List[str] = []
    seen = threading.Event()

    def on_events(batch) -> None:
        events.extend(ev.key for ev in batch)
        seen.set()

    with secure.settings(job, password_file=str(pw)).connect(JobKeys(job).ping) as store:
        store.put(keys.config, "1")
        for expiry in range(2):
            time.sleep(TOKEN_TTL + 1.5)  # idle past the token's TTL: etcd forgets the token
            assert store.get(keys.config).value == b"1", f"read after expiry {expiry}"
        assert store.token_renewals >= 2, store.token_renewals
        time.sleep(TOKEN_TTL + 1.5)
        cancel = store.watch_prefix(keys.progress, on_events, lambda err: None)  # made with an expired token
        try:
            store.put(keys.progress_of("n1"), "x")
            assert seen.wait(10), "a watch made after the token expired must deliver events"
        finally:
            cancel()
        lease = store.grant_lease(5)
        time.sleep(TOKEN_TTL + 1.5)
        assert store.refresh_lease(lease) > 0
        secure.restart()
        store.put(keys.state, "after-restart")
        assert store.get(keys.state).value == b"after-restart"
    assert keys.progress_of("n1") in events


def test_watches_made_after_a_token_renewal_see_changes(secure: SecureEtcd, tmp_path: Path):
    """etcd checks a new watch against the token its stream was opened with: once that token expired, the
    watch was refused, pyetcd kept it (silent) and the stream's other watches went silent too. A job's view
    makes new watches when it re-reads the job (a new leader, a resync): it must keep seeing the job's changes."""
    job, _, pw = _job_user(secure, tmp_path)
    keys = JobKeys(job)
    with secure.settings(job, password_file=str(pw)).connect(keys.ping) as store:
        view = JobView(store, keys)  # its watches open the client's stream, with today's token
        try:
            time.sleep(TOKEN_TTL + 1.5)  # idle past the token's TTL: etcd forgets it
            assert store.get(keys.config) is None  # a read renews the client's token
            assert store.token_renewals >= 1, store.token_renewals
            view.resync()  # new watches: on a stream opened with the expired token, they were refused
            for value in ("1", "2"):
                store.put(keys.config, value)
                wait_until(lambda v=value.encode(): (kv := view.get(keys.config)) is not None and kv.value == v, 10,
                           f"the view to see config {value} (a watch made after the renewal)")
        finally:
            view.close()


# -- a whole job ------------------------------------------------------------------------------------


def _proc_text(pid: int) -> str:
    parts = []
    for name in ("environ", "cmdline"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                parts.append(f.read().decode(errors="replace"))
        except OSError:
            pass
    return "\n".join(parts)


def _tree(agent: Agent) -> List[int]:
    return [agent.pid, *(p.pid for p in agent.descendants())]


def _steps(text: str, world: int) -> List[int]:
    return [int(m[1]) for m in re.finditer(rf"\]:step (\d+) loss \S+ world {world}$", text, re.M)]


def _checkpoints(root: Path) -> Dict[str, dict]:
    """Complete checkpoints under ``root`` by name (their metadata)."""
    out = {}
    for meta in root.glob("step-*/metadata.json"):
        try:
            out[meta.parent.name] = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
    return out


def _topology(secure: SecureEtcd, job: str) -> dict:
    with secure.settings("root").connect() as root:
        return root.get_json(JobKeys(job).topology) or {}


def test_two_node_job_with_a_limited_user_survives_expiry_restart_and_resize(
    secure: SecureEtcd, tmp_path: Path, agents
):
    job, password, pw = _job_user(secure, tmp_path)
    ckpt = tmp_path / "ckpts"
    endpoint = secure.server.endpoint
    conn = [*_tls_flags(secure), "--etcd-user", job]
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", job,
              "--heartbeat-timeout", "6", "--stability-window", "0.5", "--shutdown-timeout", "5",
              "--max-restarts", "3", *conn]
    script = [str(EXAMPLE), "--epochs", "100000", "--dataset-size", "256", "--batch-size", "8",
              "--step-sleep", "0.05", "--ckpt-every", "20", "--keep-last", "1000", "--ckpt-dir", str(ckpt),
              "--no-inplace"]  # security across restarts and a resize on the restart path (in place: its own tests)
    # --keep-last 1000: the checkpoints the CLI asked for must still be there when the test lists them (with 3,
    # a loaded host let the job commit three periodic ones in between and prune the requested one)
    clean = {names.ETCD_PASSWORD: None, names.ETCD_USER: None}
    # Node A reads the password from a file; node B from $ELASTICRUN_ETCD_PASSWORD (no standby workers).
    a = agents([*common, "--node-id", "A", "--etcd-password-file", str(pw), *script], name="A", env=clean)
    b = agents([*common, "--node-id", "B", "--no-prewarm", *script], name="B",
               env={names.ETCD_USER: None, names.ETCD_PASSWORD: password})
    text = lambda: a.stdout()  # noqa: E731 - rank 0 runs on either node; both outputs are searched
    both = lambda: a.stdout() + b.stdout()  # noqa: E731

    wait_until(lambda: len(_steps(both(), 2)) >= 5, 90, "training at world size 2")
    wait_until(lambda: any(m.get("world_size") == 2 for m in _checkpoints(ckpt).values()), 60,
               "a checkpoint committed at world size 2 (the fence reads etcd as the job's user)")

    # the password is in no command line or environment but that of agent B, which was given it
    for pid in _tree(a) + _tree(b):
        if pid != b.pid:
            assert password not in _proc_text(pid), f"the etcd password leaked into process {pid}"
    workers = [p for p in b.descendants() if any(str(EXAMPLE) in part for part in p.cmdline())]
    assert workers, "node B runs a worker"
    settings_file = psutil.Process(workers[0].pid).environ()[names.ETCD_SETTINGS_FILE]
    assert os.stat(settings_file).st_mode & 0o077 == 0, "the settings file is readable by its owner only"

    # the CLI with the job's user: status and a checkpoint request
    env = {names.ETCD_PASSWORD: None, names.ETCD_USER: None}
    cli = [*conn, "--etcd-password-file", str(pw)]
    st = run_cli(["status", "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--json", *cli], env=env)
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["world_size"] == 2
    save = run_cli(["ckpt", "save", "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--json", "--timeout", "60",
                    *cli], env=env, timeout=90)
    assert save.returncode == 0, save.stdout + save.stderr
    answer = json.loads(save.stdout)
    assert answer["name"] in _checkpoints(ckpt) and answer["root"] == str(ckpt)

    # a worker fails after the agents' tokens expired: the round restarts (no "invalid auth token")
    round0 = _topology(secure, job)["round"]
    time.sleep(2 * TOKEN_TTL + 1)
    workers[0].kill()
    wait_until(lambda: _topology(secure, job).get("restart_count", 0) >= 1, 60, "a restart after the failure")
    restarted = len(_steps(both(), 2))
    wait_until(lambda: len(_steps(both(), 2)) > restarted + 5, 90, "training again at world 2 after the failure")
    assert _topology(secure, job)["round"] > round0

    # etcd restarts (tokens and watches are lost): the job trains on and still commits checkpoints
    before = set(_checkpoints(ckpt))
    secure.restart()
    wait_until(lambda: set(_checkpoints(ckpt)) - before, 60, "a checkpoint committed after the etcd restart")
    assert a.proc.poll() is None and b.proc.poll() is None, a.stderr()[-2000:] + b.stderr()[-2000:]

    # node B leaves: the job re-forms at world size 1 and commits checkpoints there
    b.signal(signal.SIGTERM)
    wait_until(lambda: len(_steps(text(), 1)) >= 5, 90, "training at world size 1 on node A")
    wait_until(lambda: any(m.get("world_size") == 1 for m in _checkpoints(ckpt).values()), 60,
               "a checkpoint committed at world size 1")
    save = run_cli(["ckpt", "save", "--rdzv-endpoint", endpoint, "--rdzv-id", job, "--json", "--timeout", "60",
                    *cli], env=env, timeout=90)
    assert save.returncode == 0, save.stdout + save.stderr
    listed = run_cli(["ckpt", "list", str(ckpt), "--json"])
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert json.loads(save.stdout)["name"] in {r["name"] for r in rows if r["status"] == "complete"}
    assert any(r["world_size"] == 1 and r["status"] == "complete" for r in rows), rows
    a.signal(signal.SIGTERM)
    codes = wait_agents([a, b], 60)
    assert all(c in (0, 143) for c in codes), (codes, a.stderr()[-3000:], b.stderr()[-3000:])
    assert "invalid auth token" not in a.stderr() + b.stderr() + a.stdout() + b.stdout()


# -- elasticrun etcd ----------------------------------------------------------------------------------


def test_elasticrun_etcd_serves_tls_with_auth_and_job_users(tmp_path: Path):
    certs = Certs(tmp_path / "certs")
    crt, key = certs.server
    admin_crt, admin_key = certs.client("admin")
    (tmp_path / "root.pw").write_text(ROOT_PASSWORD + "\n")
    (tmp_path / "j1.pw").write_text("j1-secret\n")
    port = free_port()
    out = open(tmp_path / "etcd.out", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticrun", "etcd", "--host", "127.0.0.1", "--port", str(port), "--cert-file",
         str(crt), "--key-file", str(key), "--client-ca", str(certs.ca), "--admin-cert", str(admin_crt),
         "--admin-key", str(admin_key), "--root-password-file", str(tmp_path / "root.pw"),
         "--job-user", f"j1:{tmp_path / 'j1.pw'}", "--auth-token-ttl", "60"],
        stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO),
    )
    try:
        wait_until(lambda: "etcd serving at https://" in (tmp_path / "etcd.out").read_text()
                   or proc.poll() is not None, 60, "elasticrun etcd to serve")
        text = (tmp_path / "etcd.out").read_text()
        assert proc.poll() is None, text
        assert "TLS, client certificates, auth" in text and "warning" not in text
        base = EtcdSettings(f"127.0.0.1:{port}", ca_cert=str(certs.ca), cert=str(admin_crt), key=str(admin_key))
        with base.replace(user="j1", password="j1-secret").connect(JobKeys("j1").ping) as j1:
            j1.put(JobKeys("j1").config, "{}")
            with pytest.raises(StoreError, match="denied user 'j1'"):
                j1.get(JobKeys("other").config)
        with pytest.raises(StoreError, match="wrong user name or password"):
            base.replace(user="j1", password="nope").connect(JobKeys("j1").ping)
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="TLS with etcd .* failed"):  # no client certificate: no connection
            base.replace(cert=None, key=None, user="j1", password="j1-secret").connect(JobKeys("j1").ping)
        assert time.monotonic() - t0 < 5, "a certificate problem is reported at once, not retried like an outage"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, (tmp_path / "etcd.out").read_text()
        out.close()


def test_elasticrun_etcd_bad_host_busy_port_and_open_warning(tmp_path: Path):
    assert_one_line_error(run_cli(["etcd", "--host", "no-such-host.invalid", "--port", str(free_port())]),
                          "cannot listen on 'no-such-host.invalid'")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        assert_one_line_error(run_cli(["etcd", "--port", str(port)]), f"port {port} on 127.0.0.1 is already in use")
    assert_one_line_error(run_cli(["etcd", "--root-password-file", str(tmp_path / "pw")]), "needs TLS")
    out = open(tmp_path / "open.out", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "elasticrun", "etcd", "--host", "0.0.0.0", "--port",
                             str(free_port("0.0.0.0"))], stdout=out, stderr=subprocess.STDOUT, cwd=str(REPO))
    try:
        wait_until(lambda: "etcd serving" in (tmp_path / "open.out").read_text() or proc.poll() is not None, 60,
                   "elasticrun etcd on 0.0.0.0")
        text = (tmp_path / "open.out").read_text()
        assert "warning: etcd listens on 0.0.0.0 without TLS or authentication" in text, text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        out.close()
