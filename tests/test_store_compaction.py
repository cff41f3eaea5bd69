"""etcd stays bounded in a long job: compaction, trimmed history, and a clear NOSPACE error.

Real etcd servers started by elasticrun's own server code; the load is many simulated nodes'
real :class:`~elasticrun.train.ProgressReporter` writes at a high rate. Run as a script to
measure the figures of docs/reliability.md::

    python tests/test_store_compaction.py --nodes 64 --seconds 60 --retention 5s
    python tests/test_store_compaction.py --nodes 64 --seconds 60 --retention off   # without compaction
"""

from __future__ import annotations

import argparse
import time
from typing import Dict, List, Optional

import pytest

from elasticrun.errors import ConfigError, StoreFullError
from elasticrun.job.exitcodes import ExitCode, for_error
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.protocol import Rendezvous, RendezvousSettings
from elasticrun.rendezvous.records import NodeInfo
from elasticrun.rendezvous.writer import EVENT_HISTORY
from elasticrun.store.client import EtcdStore
from elasticrun.store.compaction import Retention, parse_retention
from elasticrun.store.server import EtcdServer
from elasticrun.train import ElasticState, ProgressReporter

from helpers.etcd_status import db_status
from helpers.fake_store import FakeStore
from helpers.procs import wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

#: A conservative floor of what one progress write costs etcd's database file when it is kept
#: (measured: about 245 bytes; see docs/reliability.md): the bound below is stricter with a floor.
BYTES_PER_WRITE_FLOOR = 200


def drive(server: EtcdServer, nodes: int, seconds: float, interval: float = 0.02,
          on_tick=None) -> Dict[str, float]:
    """``nodes`` progress reporters (one per simulated node) writing every ``interval`` s for ``seconds``
    (or until ``on_tick(elapsed, writes)`` returns True)."""
    job = "growth"
    reporters = [
        ProgressReporter(ElasticState(rdzv_endpoint=server.endpoint, rdzv_id=job, node_id=f"node-{i:04d}@host-{i}:1",
                                      rank=8 * i, world_size=8 * nodes, launched=True, elastic=True),
                         interval=interval, ttl=10)
        for i in range(nodes)
    ]
    start = time.monotonic()
    step = 0
    try:
        while time.monotonic() - start < seconds:
            step += 1
            for r in reporters:
                r.report(step, loss=2.0 + 1.0 / step, samples=step * 256)
            if on_tick is not None and on_tick(time.monotonic() - start, sum(r.puts for r in reporters)):
                break
            time.sleep(interval / 2)
    finally:
        for r in reporters:
            r.close(1.0)
    writes = sum(r.puts for r in reporters)
    return {"writes": writes, "seconds": time.monotonic() - start}


def test_compaction_bounds_history_and_db_size_under_many_nodes_progress():
    """48 simulated nodes' progress (up to 50 writes/s each; 3000 writes at least), 1 s retention:
    the compacted revision follows the head, history older than ~2 retentions is gone, and the
    database file stops growing: the second half's writes take less than half the bytes they would
    if kept."""
    retention = parse_retention("1s")
    with EtcdServer(retention=retention, unsafe_no_fsync=True) as server, EtcdStore(server.endpoint) as store:
        marks: List[Dict[str, float]] = []

        def tick(at: float, writes: int) -> bool:
            if not marks or at - marks[-1]["at"] >= 1.0:
                marks.append({"at": at, "writes": writes, **db_status(store)})
            return at >= 8.0 and writes >= 3000  # a loaded machine writes slower: drive on (up to 30 s)

        result = drive(server, nodes=48, seconds=30.0, on_tick=tick)
        marks.append({"at": result["seconds"], "writes": result["writes"], **db_status(store)})
        rate = result["writes"] / result["seconds"]
        assert result["writes"] >= 3000, f"too little load to show anything: {rate:.0f} writes/s"
        # The compacted revision follows the head: at most ~2 retentions of history are kept
        # (etcd compacts every retention to the revision of one retention before).
        end = wait_until(lambda: (lambda s: s if s["compact_revision"] > marks[-1]["revision"] - 4 * rate
                                  else None)(db_status(store)), 10, "compaction to catch up with the writes")
        assert end["compact_revision"] > next(m for m in marks if m["at"] >= marks[-1]["at"] / 2)["revision"], marks
        # The file stops growing: the writes of the second half cost less than half what they would if kept.
        mid, last = next(m for m in marks if m["at"] >= marks[-1]["at"] / 2), marks[-1]
        second_half = last["writes"] - mid["writes"]
        growth = last["db_size"] - mid["db_size"]
        assert second_half > 1000, marks
        assert growth < 0.5 * second_half * BYTES_PER_WRITE_FLOOR, (growth, second_half, marks)


def test_full_etcd_says_nospace_and_what_to_run():
    """An etcd with a tiny quota, filled until the NOSPACE alarm fires: the error says so, with the
    commands to run, not "unreachable"; reads and deletes still work."""
    with EtcdServer(quota_bytes=256 * 1024, unsafe_no_fsync=True) as server, EtcdStore(server.endpoint) as store:
        err: Optional[StoreFullError] = None
        deadline = time.monotonic() + 20
        i = 0
        while err is None and time.monotonic() < deadline:
            try:
                store.put(f"/fill/{i}", "x" * 2048)
            except StoreFullError as e:
                err = e
            i += 1
        assert err is not None, "the quota alarm never fired"
        msg = str(err)
        assert "out of space" in msg and "NOSPACE" in msg, msg
        for what in ("alarm disarm", "defrag", "compact", "--quota-backend-bytes", server.endpoint):
            assert what in msg, (what, msg)
        assert "unreachable" not in msg and "\n" not in msg
        assert for_error(err) == ExitCode.TRANSIENT  # retryable: the scheduler tries again once space is freed
        assert store.get("/fill/0") is not None  # reads still answer
        with pytest.raises(StoreFullError):
            store.grant_lease(5)  # an agent cannot even register: it says why


def test_agent_says_etcd_is_full_not_unreachable(agents, job_id, tmp_path):
    """A real agent whose etcd fills up while its worker runs: reporting the worker's success is
    refused, and the agent says NOSPACE and what to run (old code: "etcd does not answer", then
    "etcd unreachable for 4s"), then gives up after --etcd-outage-grace with the retryable exit code 138."""
    from helpers.launch import ECHO

    pids = tmp_path / "pids"
    pids.mkdir()
    with EtcdServer(quota_bytes=1024 * 1024, unsafe_no_fsync=True) as server, EtcdStore(server.endpoint) as store:
        agent = agents(["run", "--rdzv-backend", "etcd", "--rdzv-endpoint", server.endpoint, "--rdzv-id", job_id,
                        "--nnodes", "1", "--nproc-per-node", "1", "--etcd-outage-grace", "4", ECHO],
                       env={"ECHO_SLEEP_S": "4", "ECHO_PID_DIR": str(pids)})
        wait_until(lambda: (pids / "0.pid").exists(), 60, "the worker to start")
        i = 0
        with pytest.raises(StoreFullError):
            while i < 10_000:
                store.put(f"/fill/{i}", "x" * 8192)
                i += 1
        assert agent.wait(60) == ExitCode.TRANSIENT, agent.output()
        err = agent.stderr()
        assert "is out of space (NOSPACE alarm" in err and "alarm disarm" in err, err
        assert "unreachable" not in err and "does not answer" not in err, err
        assert "Traceback" not in err, err


def test_retention_values(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("ELASTICRUN_ETCD_COMPACTION_RETENTION", raising=False)
    assert parse_retention("5m").args() == ["--auto-compaction-mode=periodic", "--auto-compaction-retention=5m"]
    assert parse_retention("10000rev").args() == ["--auto-compaction-mode=revision",
                                                  "--auto-compaction-retention=10000"]
    for bad in ("", "0s", "5", "5x", "-1m", "rev"):
        with pytest.raises(ConfigError, match="expected a time such as 30s"):
            parse_retention(bad)
    assert EtcdServer().retention == parse_retention("5m"), "every etcd elasticrun starts compacts"


def test_round_history_is_trimmed_without_gaps(store: FakeStore):
    """The newest EVENT_HISTORY rounds' events and round keys are kept, every older one goes: also
    after trims that never ran (old code trimmed only when newest-50 was a multiple of 10, so a
    missed one left its rounds behind for ever)."""
    keys = JobKeys("j")
    rdzv = Rendezvous(store, RendezvousSettings("j", 1, 1, 0, 5.0, 1.0, 5.0, 5.0),
                      NodeInfo(node_id="a", host="h", addr="127.0.0.1", nproc=1, pid=1), lambda: 1)

    def plant(first: int, last: int) -> None:
        for n in range(first, last + 1):
            store.put(keys.event(n), "{}")
            store.put(keys.failed(n), "{}")
            store.put(keys.done(n, "a"), "{}")

    def kept() -> List[int]:
        return sorted(int(kv.key.rsplit("/", 1)[-1]) for kv in store.get_prefix(keys.events)[0])

    plant(0, 99)
    rdzv.writer.trim_history(99)
    assert kept() == list(range(100 - EVENT_HISTORY, 100))
    rounds = {kv.key[len(keys.rounds):].split("/")[0] for kv in store.get_prefix(keys.rounds)[0]}
    assert rounds == {f"{n:08d}" for n in range(100 - EVENT_HISTORY, 100)}
    plant(100, 137)  # 38 rounds whose trims failed or never ran
    rdzv.writer.trim_history(137)
    assert kept() == list(range(138 - EVENT_HISTORY, 138))
    assert not [kv for kv in store.get_prefix(keys.rounds)[0] if kv.key < keys.round(138 - EVENT_HISTORY)]


def _main() -> None:
    ap = argparse.ArgumentParser(description="Measure etcd's database under simulated nodes' progress writes.")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--interval", type=float, default=0.02, help="seconds between one node's writes")
    ap.add_argument("--retention", default="5s", help="a compaction retention, or 'off'")
    args = ap.parse_args()
    retention = None if args.retention == "off" else parse_retention(args.retention)
    server = EtcdServer(retention=retention or Retention("periodic", "0"), unsafe_no_fsync=True).start()
    try:
        with EtcdStore(server.endpoint) as store:
            base = db_status(store)
            rows: List[Dict[str, float]] = []

            def tick(at: float, writes: int) -> bool:
                if not rows or at - rows[-1]["at"] >= args.seconds / 10:
                    rows.append({"at": at, "writes": writes, **db_status(store)})
                return False

            res = drive(server, args.nodes, args.seconds, args.interval, tick)
            end = db_status(store)
        print(f"{args.nodes} nodes, {res['writes']:.0f} writes in {res['seconds']:.1f}s "
              f"({res['writes'] / res['seconds']:.0f}/s), retention {args.retention}")
        print(f"{'t/s':>6} {'writes':>8} {'revision':>9} {'compacted':>9} {'db bytes':>10}")
        for r in [*rows, {"at": res["seconds"], "writes": res["writes"], **end}]:
            print(f"{r['at']:6.1f} {r['writes']:8.0f} {r['revision']:9d} {r['compact_revision']:9d} {r['db_size']:10d}")
        print(f"db bytes per write kept: {(end['db_size'] - base['db_size']) / max(1, res['writes']):.0f}")
    finally:
        server.stop()


if __name__ == "__main__":
    _main()
