"""A replicated etcd (3 members on loopback) under a running 2-node job: a partitioned member.

A member that is SIGSTOPped still accepts TCP connections but never answers: the stand-in for a
partitioned or hung member (worse for a client than a dead one, whose connections are refused).
Member SIGKILL without TLS (leader and follower) is covered by
test_elastic.test_etcd_member_loss_does_not_disturb_job; here with TLS and a per-job user.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path
from typing import Iterator, List

import psutil
import pytest

from elasticrun.errors import StoreError
from elasticrun.job import env as names
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.view import JobView
from elasticrun.store.client import connect
from elasticrun.store.members import list_members
from elasticrun.store.server import EtcdCluster, EtcdServer

from helpers.elastic import agent_args, first_step, steps
from helpers.procs import wait_until
from helpers.tls import start_secure_cluster

pytestmark = pytest.mark.integration  # starts etcd or processes


@contextlib.contextmanager
def _held(port: int) -> Iterator[None]:
    """Another process's listener on ``port`` (taken between "free" and etcd's bind)."""
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        yield


def test_a_cluster_whose_port_was_taken_before_it_started_starts_on_new_ports() -> None:
    """The members' ports are free when they are made; another process may bind one before etcd does (a busy
    host: seen under three test processes). The cluster starts again on new ports instead of failing."""
    cluster = EtcdCluster(3)
    taken = cluster.members["etcd2"].peer_port
    with _held(taken):
        try:
            cluster.start()
            assert taken not in {p for m in cluster.members.values() for p in (m.client_port, m.peer_port)}
            with connect(cluster.endpoints) as store:
                store.put("/k", "v")
                assert store.get("/k").value == b"v"
                assert len(list_members(store)) == 3
        finally:
            cluster.stop()


def test_a_single_etcd_moves_off_a_port_it_chose_but_not_off_one_it_was_given() -> None:
    """The same race for one member: ports it chose itself are chosen again; a port the caller gave (a job's
    endpoint, ``elasticrun etcd --port``) is that port or one clear error."""
    server = EtcdServer(unsafe_no_fsync=True)
    taken = server.client_port
    with _held(taken):
        try:
            server.start()
            assert server.client_port != taken and server.healthy()
        finally:
            server.stop()
        given = EtcdServer(client_port=taken, unsafe_no_fsync=True)
        with pytest.raises(StoreError, match=f"port {taken} on 127.0.0.1 is already in use"):
            given.start()
        given.stop()


def test_a_watch_on_a_frozen_member_moves_to_another_and_misses_nothing(tmp_path: Path) -> None:
    """A job view's watch sits on the member its store uses; that member is frozen: changes made meanwhile
    (on the others) reach the view once the watch moved, within the store's call deadline (old code: never)."""
    with EtcdCluster(3) as cluster:
        store = connect(cluster.endpoints, timeout=2.0)
        keys = JobKeys("frozen-watch")
        view = JobView(store, keys)
        on = store._client.watchers[-1].label  # the member the view's watch stream is on
        frozen = next(m for m in cluster.members.values() if m.endpoint == on)
        # Its writes wait out an election when the frozen member led: a generous retry.
        others = connect(",".join(m.endpoint for m in cluster.members.values() if m is not frozen),
                         retry_timeout=60.0)
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            others.put(keys.state, "{}")
            others.put(keys.topology, '{"round": 7}')
            wait_until(lambda: view.get(keys.topology) is not None and view.get(keys.state) is not None, 30,
                       "the view to see the changes made while its member was frozen")
            assert store.watchdog.failovers >= 1
            assert store._client.watchers[-1].label != on
            others.delete(keys.state)
            wait_until(lambda: view.get(keys.state) is None, 10, "the moved watch to deliver a later change")
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
            view.close()
            others.close()
            store.close()


def _members_used_by(pid: int, cluster: EtcdCluster) -> List[str]:
    """The members that process ``pid`` holds a connection to (its client uses one at a time)."""
    ports = {int(m.endpoint.rsplit(":", 1)[1]): name for name, m in cluster.members.items()}
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sorted({ports[c.raddr.port] for c in conns if c.raddr and c.raddr.port in ports
                   and c.status == psutil.CONN_ESTABLISHED})


def test_a_frozen_member_under_an_agents_watch_does_not_disturb_the_job(job_id: str, agents, tmp_path: Path) -> None:
    """The member agent A's client (its calls, keep-alives and its watch stream) is on is frozen: the
    keep-alives fail over within their deadline, the watch within the store's call deadline (it
    would otherwise wait forever and A would never see the job end). Frozen is the leader when A
    sits on it, else a follower; both need the same failover from A."""
    out = tmp_path / "out"
    out.mkdir()
    with EtcdCluster(3) as cluster:
        store = connect(cluster.endpoints)
        stopped = None
        try:
            # 120 steps: still >= 10 s of training after the freeze, past the lease (3 s) and the agents'
            # call deadline (5 s), so a keep-alive or a watch left on the frozen member would show
            a = [agents(agent_args(cluster.endpoints, job_id, n, "2", out, 120), name=n) for n in "AB"]
            wait_until(lambda: first_step(out, 2), 90, "training at world size 2")
            used = wait_until(lambda: _members_used_by(a[0].pid, cluster), 10, "agent A's etcd connection")
            assert len(used) == 1, f"agent A talks to one member at a time, not {used}"
            stopped = cluster.members[used[0]].proc
            os.kill(stopped.pid, signal.SIGSTOP)
            frozen_at = time.time()
            at_stop = len(steps(out))
            wait_until(lambda: len(steps(out)) >= at_stop + 30, 60, "training to go on with A's member frozen")
            for ag in a:
                assert ag.wait(120) == 0, ag.output()
            os.kill(stopped.pid, signal.SIGCONT)
            stopped = None
            assert {r["round"] for r in steps(out)} == {0}, "a frozen etcd member must not re-form the job"
            trained = steps(out)[-1]["time"] - frozen_at
            assert trained >= 6, f"the job ended {trained:.1f}s after the freeze: too soon to test the failover"
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
