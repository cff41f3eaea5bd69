"""``elasticrun status``: the status document, the rich view, job listing, errors, --watch.

Real etcd throughout. One test runs two real agents; the others drive the real
rendezvous protocol in-process (threads with a fake store port) to get spares, rescale
events, failure flags and a terminal state without waiting for workers.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from elasticrun.cli import console as console_mod
from elasticrun.cli.main import main
from elasticrun.job.exitcodes import ExitCode
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.jobstatus import job_status, list_jobs
from elasticrun.rendezvous.protocol import JobEnded, LeaseLost, Rendezvous, RendezvousSettings
from elasticrun.rendezvous.records import NodeInfo, Topology, WorkerStatus
from elasticrun.store.client import EtcdStore
from elasticrun.store.server import EtcdServer, free_port

from helpers.procs import REPO, SCRIPTS, wait_until, worker_env

pytestmark = pytest.mark.integration  # starts etcd or processes


def cli(argv: List[str], capsys: pytest.CaptureFixture[str]) -> tuple:
    """Run ``elasticrun <argv>`` in-process; (exit code, stdout, stderr)."""
    code = 0
    try:
        main(argv)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables wide enough that node ids are never wrapped (stdout is not a TTY under pytest)."""
    monkeypatch.setattr(console_mod.console, "width", 220)


def make_node(
    store: EtcdStore, job: str, node_id: str, port: int, min_nodes: int = 2, max_nodes: int = 2
) -> Rendezvous:
    settings = RendezvousSettings(
        job_id=job, min_nodes=min_nodes, max_nodes=max_nodes, max_restarts=3, heartbeat_timeout=3,
        stability_window=0.1, rescale_timeout=30, join_timeout=30,
    )
    info = NodeInfo(
        node_id=node_id, host=f"host-{node_id}", addr="127.0.0.1", nproc=2, pid=os.getpid(),
        accelerators=[{"type": "cpu", "count": 2}],
    )
    rdzv = Rendezvous(store, settings, info, host_store=lambda: port)
    rdzv.ensure_config({"nnodes": f"{min_nodes}:{max_nodes}", "max_restarts": 3})
    rdzv.register()
    return rdzv


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    ex = ThreadPoolExecutor(4)
    yield ex
    ex.shutdown(wait=True)


@pytest.fixture
def three_nodes(etcd: EtcdStore, job_id: str, pool: ThreadPoolExecutor) -> Iterator[Dict[str, Any]]:
    """Nodes a, b, c (2 workers each) with max 2: round 0 = [a, b], c waits as a spare."""
    nodes = {n: make_node(etcd, job_id, n, 40000 + i) for i, n in enumerate("abc")}
    futures: Dict[str, Future] = {n: pool.submit(nodes[n].next_round) for n in "ab"}
    topo = futures["a"].result(20)
    assert futures["b"].result(20).round == topo.round == 0
    futures["c"] = pool.submit(nodes["c"].next_round)  # round 0 is full: c waits for round 1
    wait_until(lambda: nodes["c"].node.waiting_for == 1, 10, "c waiting as a spare")
    for n in "ab":
        nodes[n].publish(status=WorkerStatus.ACTIVE, waiting_for=-1)
    yield {"nodes": nodes, "futures": futures, "topo": topo}
    for r in nodes.values():
        r.leave()  # a spare still in next_round sees its lease gone (LeaseLost) or the job stopped (JobEnded)
    for f in futures.values():
        try:
            f.result(10)
        except (LeaseLost, JobEnded):
            pass


def test_status_document_spares_progress_and_events(
    etcd: EtcdStore, job_id: str, three_nodes: Dict[str, Any], pool: ThreadPoolExecutor,
    capsys: pytest.CaptureFixture[str], etcd_server: EtcdServer, wide_console: None,
) -> None:
    keys = JobKeys(job_id)
    nodes = three_nodes["nodes"]
    etcd.put_json(keys.progress + "a", {"step": 120, "loss": 0.5, "samples_per_s": 33.0, "time": time.time()})
    wait_until(lambda: job_status(etcd, job_id)["spares"], 10, "c registered as a spare")

    code, out, err = cli(["status", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id, "--json"], capsys)
    assert code == 0, err
    doc = json.loads(out)  # exactly one JSON document
    assert doc["job"] == job_id and doc["round"] == 0 and doc["world_size"] == 4
    assert doc["nnodes"] == "2:2" and doc["max_restarts"] == 3 and doc["restart_count"] == 0
    assert doc["phase"] == "running" and doc["state"] is None
    assert [(m["node_id"], m["group_rank"], m["ranks"], m["status"]) for m in doc["members"]] == [
        ("a", 0, [0, 1], "Active"),
        ("b", 1, [2, 3], "Active"),
    ]
    a = doc["members"][0]
    assert a["host"] == "host-a" and a["accelerators"] == [{"type": "cpu", "count": 2}]
    assert a["progress"]["step"] == 120 and doc["members"][1]["progress"] is None
    assert 0 < a["lease_ttl"] <= a["lease_granted_ttl"] == 3
    assert a["heartbeat_at"] <= time.time()
    assert doc["master_port"] == 40000
    assert [s["node_id"] for s in doc["spares"]] == ["c"]
    assert doc["spares"][0]["waiting_for"] == 1 and doc["spares"][0]["status"] == "Joining"
    assert [(e["type"], e["round"], e["new_world_size"]) for e in doc["events"]] == [("Start", 0, 4)]

    # b leaves: a and the spare c form round 1 (Replace); ranks stay stable for a.
    nodes["b"].leave()
    topo1: Topology = pool.submit(nodes["a"].next_round).result(20)
    assert three_nodes["futures"]["c"].result(20).round == topo1.round == 1
    for n in "ac":
        nodes[n].publish(status=WorkerStatus.ACTIVE, waiting_for=-1)
    doc = job_status(etcd, job_id)
    assert doc["round"] == 1 and [m["node_id"] for m in doc["members"]] == ["a", "c"] and doc["spares"] == []
    ev = doc["events"][0]
    assert (ev["type"], ev["round"], ev["added"], ev["removed"]) == ("Replace", 1, ["c"], ["b"])
    assert (ev["old_world_size"], ev["new_world_size"]) == (4, 4) and ev["reason"]
    assert [e["round"] for e in doc["events"]] == [1, 0]

    # A worker failure on c: c shows Failed and the round is ending.
    nodes["c"].report_failure(topo1, [{"rank": 2, "exitcode": 1}])
    doc = job_status(etcd, job_id)
    assert doc["members"][1]["status"] == "Failed" and doc["members"][1]["failed_workers"][0]["rank"] == 2
    assert doc["round_end"]["failed"]["node"] == "c" and doc["phase"] == "rescaling"

    code, out, err = cli(["status", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id], capsys)
    assert code == 0, err
    for text in (f"job {job_id}", "round 1", "world size 4", "restarts 0/3", "Replace", "4→4", "Failed",
                 "host-a", "cpu x2", "worker failure on c", "step 120"):
        assert text in out, f"{text!r} missing from:\n{out}"

    # Terminal state.
    nodes["a"].mark_succeeded(topo1)
    doc = job_status(etcd, job_id)
    assert doc["state"]["state"] == "succeeded" and doc["phase"] == "succeeded"
    row = next(r for r in list_jobs(etcd) if r["job"] == job_id)
    assert (row["phase"], row["round"], row["world_size"], row["nodes"]) == ("succeeded", 1, 4, 2)


def test_job_listing(
    etcd: EtcdStore, job_id: str, three_nodes: Dict[str, Any], capsys: pytest.CaptureFixture[str],
    etcd_server: EtcdServer, wide_console: None,
) -> None:
    other = job_id + "-forming"
    lone = make_node(etcd, other, "z", 41000)
    try:
        code, out, err = cli(["status", "--rdzv-endpoint", etcd_server.endpoint, "--json"], capsys)
        assert code == 0, err
        rows = {r["job"]: r for r in json.loads(out)["jobs"]}
        assert (rows[job_id]["phase"], rows[job_id]["round"], rows[job_id]["world_size"]) == ("running", 0, 4)
        assert rows[job_id]["nodes"] == 3 and rows[job_id]["members"] == 2
        assert (rows[other]["phase"], rows[other]["round"], rows[other]["nodes"]) == ("forming", None, 1)

        code, out, err = cli(["status", "--rdzv-endpoint", etcd_server.endpoint], capsys)
        assert code == 0, err
        assert job_id in out and other in out and "running" in out and "forming" in out
    finally:
        lone.leave()


def test_unknown_job_is_one_line(
    etcd: EtcdStore, job_id: str, capsys: pytest.CaptureFixture[str], etcd_server: EtcdServer
) -> None:
    code, out, err = cli(["status", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id + "-nope"], capsys)
    assert code != 0 and out == ""
    assert f"no job '{job_id}-nope'" in err and "--rdzv-id" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_unreachable_etcd_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    code, out, err = cli(["status", "--rdzv-endpoint", endpoint, "--rdzv-id", "x", "--timeout", "1"], capsys)
    assert code == ExitCode.TRANSIENT and out == ""
    assert "cannot reach etcd" in err and endpoint in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert time.monotonic() - started < 10


def test_missing_endpoint_is_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTICRUN_RDZV_ENDPOINT", raising=False)
    code, _, err = cli(["status", "--rdzv-id", "x"], capsys)
    assert code != 0 and "--rdzv-endpoint" in err and len(err.strip().splitlines()) == 1


class Lines:
    """Stdout lines of a child process, read on a thread, with deadlines."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.q: queue.Queue = queue.Queue()
        self.seen: List[str] = []
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            self.q.put(line)

    def until(self, predicate: Any, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            self.seen.append(line)
            if predicate(line):
                return line
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; output:\n{''.join(self.seen)}")


def status_proc(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "elasticrun", "status", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO),
        env=worker_env({"COLUMNS": "220"}),
    )


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_watch_json_follows_changes(etcd: EtcdStore, job_id: str, three_nodes: Dict[str, Any],
                                    etcd_server: EtcdServer) -> None:
    proc = status_proc("--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id, "--watch", "--json")
    try:
        lines = Lines(proc)
        first = json.loads(lines.until(lambda _: True, 20, "the first document"))
        assert first["round"] == 0 and first["members"][0]["progress"] is None
        etcd.put_json(JobKeys(job_id).progress + "a", {"step": 7, "loss": 1.0, "time": time.time()})
        lines.until(lambda line: (json.loads(line)["members"][0]["progress"] or {}).get("step") == 7, 10,
                    "a document with the new progress")
        assert stop(proc) == 0
    finally:
        stop(proc)


def test_watch_rich_to_a_pipe(etcd: EtcdStore, job_id: str, three_nodes: Dict[str, Any],
                              etcd_server: EtcdServer) -> None:
    proc = status_proc("--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id, "--watch")
    try:
        lines = Lines(proc)
        lines.until(lambda line: "members" in line, 20, "the members table")
        etcd.put_json(JobKeys(job_id).progress + "b", {"step": 99, "time": time.time()})
        lines.until(lambda line: "step 99" in line, 10, "the view redrawn with b's progress")
        assert stop(proc) == 0, proc.stderr.read() if proc.stderr else ""  # Ctrl-C exits 0
    finally:
        stop(proc)


def test_status_of_real_agents(
    agents: Any, etcd_server: EtcdServer, etcd: EtcdStore, job_id: str, tmp_path: Path
) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    common = [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id,
        "--stability-window", "0.2", "--heartbeat-timeout", "3", "--max-restarts", "3", "-q",
        str(SCRIPTS / "report_env.py"), str(out_dir),
    ]
    for name in ("alpha", "beta"):
        agents(["--node-id", name, *common], name=name, env={"SLEEP_S": "60"})

    def both_active() -> bool:
        try:
            doc = job_status(etcd, job_id, leases=False)
        except Exception:  # noqa: BLE001 - the job's keys appear once the agents start
            return False
        return len(doc["members"]) == 2 and all(m["status"] == "Active" for m in doc["members"])

    wait_until(both_active, 60, "both agents running their workers")
    proc = status_proc("--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id, "--json")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    doc = json.loads(out)
    assert doc["round"] == 0 and doc["world_size"] == 2 and doc["restart_count"] == 0 and doc["max_restarts"] == 3
    members = {m["node_id"]: m for m in doc["members"]}
    assert set(members) == {"alpha", "beta"}
    assert sorted((m["group_rank"], m["ranks"][0]) for m in members.values()) == [(0, 0), (1, 1)]
    for m in members.values():
        assert m["status"] == "Active" and m["nproc"] == 1 and m["registered"]
        assert m["addr"] == "127.0.0.1" and m["pid"] > 0 and m["accelerators"][0]["type"] == "cpu"
        assert m["lease_ttl"] is not None and 0 < m["lease_ttl"] <= 3
    leader = next(m for m in members.values() if m["group_rank"] == 0)
    assert doc["master_addr"] == leader["addr"] and doc["master_port"] > 0
    assert doc["events"][0]["type"] == "Start" and doc["spares"] == [] and doc["phase"] == "running"


def test_hostile_records_of_another_job_do_not_break_status(
    etcd: EtcdStore, job_id: str, capsys: pytest.CaptureFixture[str], etcd_server: EtcdServer
) -> None:
    """A deeply nested or malformed value written by someone else is skipped, never a traceback."""
    keys = JobKeys(job_id)
    deep = "[" * 100_000 + "]" * 100_000
    etcd.put(keys.config, deep)
    etcd.put(keys.topology, deep)
    etcd.put(keys.node("evil"), '{"node_id": 7, "host": [1]}')
    etcd.put(keys.state, "not json")
    try:
        code, out, err = cli(["status", "--rdzv-endpoint", etcd_server.endpoint, "--json"], capsys)
        assert code == 0, err
        assert job_id in {r["job"] for r in json.loads(out)["jobs"]}
        code, out, err = cli(["status", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id, "--json"], capsys)
        assert "Traceback" not in err and "RecursionError" not in err + out
    finally:
        etcd.delete_prefix(keys.prefix)
