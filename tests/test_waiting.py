"""No long silence: the "still waiting (N s left)" cadence, the etcd reachability probe, and the waits
that use them (a node waiting for the others, ``ckpt save`` waiting for a job, an unreachable etcd)."""

from __future__ import annotations

import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List

import pytest

from elasticrun.cli.console import ProgressLines
from elasticrun.cli.main import main
from elasticrun.errors import RendezvousError, StoreError
from elasticrun.rendezvous.protocol import Rendezvous
from elasticrun.rendezvous.records import NodeInfo
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.store.client import EtcdStore
from elasticrun.store.reach import wait_for_etcd, wait_reachable
from elasticrun.store.server import EtcdServer, free_port
from elasticrun.waiting import Reminder

pytestmark = pytest.mark.integration  # starts etcd or processes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_reminder_says_the_wait_again_with_the_time_left() -> None:
    clock, said = Clock(), []
    r = Reminder(said.append, "waiting for job j to checkpoint", deadline=130.0, every=5, clock=clock)
    assert not r.tick()  # just said by the caller
    clock.now = 104.9
    assert not r.tick() and said == []
    clock.now = 105.0
    assert r.tick() and said == ["still waiting for job j to checkpoint (25 s left)"]
    clock.now = 108.0
    assert not r.tick()
    clock.now = 110.0
    assert r.tick() and said[-1].endswith("(20 s left)")


def test_a_reminder_without_deadline_counts_up_and_backs_off() -> None:
    clock, said = Clock(), []
    r = Reminder(said.append, "waiting as a spare: round 3 is full", every=5, max_every=20, clock=clock)
    times = []
    for _ in range(400):
        clock.now += 0.5
        if r.tick():
            times.append(clock.now - 100.0)
        if clock.now > 160:
            break
    assert times == [5.0, 15.0, 35.0, 55.0], times  # 5, then 10, then 20 (the cap), 20
    assert said[0] == "still waiting as a spare: round 3 is full (5 s so far)"
    r.restart("waiting for nodes: 1/2 (min) joined", deadline=200.0)
    clock.now += 5
    assert r.tick() and said[-1].startswith("still waiting for nodes: 1/2 (min) joined (")


def test_a_reminder_runs_beside_a_blocking_call() -> None:
    said: List[str] = []
    r = Reminder(said.append, "waiting for x", deadline=time.monotonic() + 10, every=0.1)
    with r.running():
        time.sleep(0.55)
    n = len(said)
    assert 3 <= n <= 6, said
    time.sleep(0.3)
    assert len(said) == n, "the helper thread stops with the with block"


def test_progress_lines_off_a_terminal() -> None:
    clock, said = Clock(), []
    p = ProgressLines("verifying step-00000200", 4 * 2**30, said.append, every=5, clock=clock)
    p.advance(2**30)
    assert said == []
    clock.now += 5
    p.advance(2**30)
    assert said == ["verifying step-00000200: 50% (2.0 GiB of 4.0 GiB)"]


# -- etcd that does not answer ---------------------------------------------------------------------


def test_an_etcd_that_refuses_is_said_at_once_and_given_up_at_the_deadline() -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    said: List[str] = []
    started = time.monotonic()
    with pytest.raises(StoreError) as err:
        wait_for_etcd(endpoint, 1.0, said.append, "--etcd-timeout")
    took = time.monotonic() - started
    assert 1.0 <= took < 2.0, took
    assert said[0] == f"etcd at {endpoint} does not answer (connection refused); retrying for up to 1 s " \
                      "(--etcd-timeout)"
    assert f"cannot reach etcd at {endpoint} (connection refused for 1 s)" in str(err.value)
    assert "--standalone" not in str(err.value)  # not every command has it


def test_an_etcd_that_comes_up_is_found_within_milliseconds() -> None:
    port = free_port()
    found: List[object] = []
    waiter = threading.Thread(target=lambda: found.append(wait_reachable(f"127.0.0.1:{port}", 30.0)))
    waiter.start()
    time.sleep(0.3)
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        up = time.monotonic()
        waiter.join(30)
        assert found == [None] and time.monotonic() - up < 1.0


@pytest.mark.parametrize("argv", [["status", "--timeout", "1"], ["ckpt", "save", "--rdzv-id", "j",
                                                                  "--etcd-timeout", "1"]])
def test_commands_without_standalone_do_not_suggest_it(argv: List[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        main([*argv, "--rdzv-endpoint", f"127.0.0.1:{free_port()}"])
    err = capsys.readouterr().err
    assert ended.value.code == 138 and "cannot reach etcd" in err and "--standalone" not in err, err


# -- waits that used to be silent ----------------------------------------------------------------------


def test_ckpt_save_says_it_still_waits_for_a_job_that_never_answers(
    etcd_server: EtcdServer, etcd: EtcdStore, job_id: str, capsys: pytest.CaptureFixture[str],
) -> None:
    etcd.put_json(f"/elasticrun/{job_id}/config", {"nnodes": "1:1"})
    etcd.put_json(f"/elasticrun/{job_id}/nodes/A", {"node_id": "A"})  # a node runs it, rank 0 never answers
    with pytest.raises(SystemExit) as ended:
        main(["ckpt", "save", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id, "--timeout", "6"])
    err = capsys.readouterr().err
    assert ended.value.code == 5, err
    assert f"waiting for job {job_id} to checkpoint (up to 6 s, --timeout)" in err
    assert re.search(rf"still waiting for job {job_id} to checkpoint \(\d s left\)", err), err


def _node(store: EtcdStore, job: str, node_id: str, said: List[str]) -> Rendezvous:
    settings = RendezvousSettings(job_id=job, min_nodes=2, max_nodes=2, max_restarts=0, heartbeat_timeout=3,
                                  stability_window=0.1, rescale_timeout=30, join_timeout=2.5)
    info = NodeInfo(node_id=node_id, host="h", addr="127.0.0.1", nproc=1, pid=1)
    rdzv = Rendezvous(store, settings, info, host_store=lambda: 40000, on_progress=said.append)
    rdzv.ensure_config({"nnodes": "2:2", "max_restarts": 0})
    rdzv.register()
    return rdzv


def test_a_node_waiting_for_the_others_says_so_with_the_time_left(etcd: EtcdStore, job_id: str) -> None:
    said: List[str] = []
    rdzv = _node(etcd, job_id, "a", said)
    rdzv._reminder.every = rdzv._reminder.max_every = 0.5  # noqa: SLF001 - the cadence, shortened for the test
    try:
        with ThreadPoolExecutor(1) as pool, pytest.raises(RendezvousError):
            pool.submit(rdzv.next_round).result(30)
    finally:
        rdzv.leave()
    waits = [s for s in said if "nodes: 1/2 (min) joined" in s]
    assert waits[0] == "waiting for nodes: 1/2 (min) joined", said
    again = [s for s in waits if s.startswith("still waiting for nodes: 1/2 (min) joined (")]
    assert len(again) >= 2 and again[0].endswith(" s left)"), said
