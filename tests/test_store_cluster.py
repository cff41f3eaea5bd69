"""A replicated etcd (3 members on loopback) under a running 2-node job: a partitioned member.

A member that is SIGSTOPped still accepts TCP connections but never answers: the stand-in for a
partitioned or hung member (worse for a client than a dead one, whose connections are refused).
Member SIGKILL without TLS (leader and follower) is covered by
test_elastic.test_etcd_member_loss_does_not_disturb_job; here with TLS and a per-job user.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from elasticrun.job import env as names
from elasticrun.job.keys import JobKeys
from elasticrun.store.client import connect
from elasticrun.store.server import EtcdCluster

from helpers.elastic import agent_args, first_step, steps
from helpers.procs import wait_until
from helpers.tls import start_secure_cluster


@pytest.mark.xfail(strict=False, reason=(
    "known bug: an agent whose watch stream sits on the frozen member never sees the round's end (only "
    "keep-alives fail over today), so it may wait past the test's 120 s; passes when no watch is on that member"))
def test_partitioned_leader_does_not_disturb_the_job(job_id: str, agents, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with EtcdCluster(3) as cluster:
        store = connect(cluster.endpoints)
        stopped = None
        try:
            a = [agents(agent_args(cluster.endpoints, job_id, n, "2", out, 250), name=n) for n in "AB"]
            wait_until(lambda: first_step(out, 2), 90, "training at world size 2")
            leader = store.leader()
            assert leader in cluster.members
            stopped = cluster.members[leader].proc
            os.kill(stopped.pid, signal.SIGSTOP)
            at_stop = len(steps(out))
            wait_until(lambda: len(steps(out)) >= at_stop + 30, 60, "training to go on with the leader frozen")
            for ag in a:
                assert ag.wait(120) == 0, ag.output()
            os.kill(stopped.pid, signal.SIGCONT)
            stopped = None
            assert {r["round"] for r in steps(out)} == {0}, "a frozen etcd leader must not re-form the job"
            kv = store.get(JobKeys(job_id).topology)
            assert kv is not None and kv.json()["round"] == 0
        finally:
            if stopped is not None:
                os.kill(stopped.pid, signal.SIGCONT)
            store.close()


def test_tls_and_a_job_user_on_a_cluster_survive_the_leader_loss(job_id: str, agents, tmp_path: Path) -> None:
    """TLS with client certificates and a per-job user on 3 members: the leader's SIGKILL is invisible."""
    out = tmp_path / "out"
    out.mkdir()
    cluster, secure = start_secure_cluster(tmp_path / "certs")
    try:
        password = "pw-cluster-0a1b"
        secure.add_job_user(job_id, password)
        pw = tmp_path / "job.pw"
        pw.write_text(password + "\n")
        pw.chmod(0o600)
        crt, key = secure.certs.client("elasticrun-client")
        env = {names.ETCD_CACERT: str(secure.certs.ca), names.ETCD_CERT: str(crt), names.ETCD_KEY: str(key),
               names.ETCD_USER: job_id, names.ETCD_PASSWORD_FILE: str(pw), names.ETCD_PASSWORD: None}
        a = [agents(agent_args(cluster.endpoints, job_id, n, "2", out, 150), name=n, env=env) for n in "AB"]
        wait_until(lambda: first_step(out, 2), 90, "training at world size 2")
        with secure.settings("root").connect() as root:
            leader = root.leader()
        assert leader in cluster.members
        cluster.members[leader].kill()
        at_kill = len(steps(out))
        wait_until(lambda: len(steps(out)) >= at_kill + 20, 60, "training to go on without the leader")
        for ag in a:
            assert ag.wait(120) == 0, ag.output()
        assert {r["round"] for r in steps(out)} == {0}, "losing the etcd leader must not re-form the job"
    finally:
        cluster.stop()
