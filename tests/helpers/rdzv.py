"""The rendezvous protocol driven on an in-memory store: settings, joining nodes, rounds formed
by every node at once (as their agents do), and waits on a node's view."""

from __future__ import annotations

import threading
import time
from typing import Dict, List

from elasticrun.rendezvous.protocol import Rendezvous, RendezvousSettings
from elasticrun.rendezvous.records import NodeInfo, Topology

from helpers.fake_store import FakeStore

JOB = "unit-job"


def settings(**kw) -> RendezvousSettings:
    base = dict(job_id=JOB, min_nodes=1, max_nodes=3, max_restarts=1, heartbeat_timeout=2.0, stability_window=0.05,
                rescale_timeout=10.0, join_timeout=10.0)
    base.update(kw)
    return RendezvousSettings(**base)


def join(store: FakeStore, node_id: str, **kw) -> Rendezvous:
    info = NodeInfo(node_id=node_id, host="h", addr="127.0.0.1", nproc=kw.pop("nproc", 1), pid=1)
    rdzv = Rendezvous(store, settings(**kw), info, lambda: 29500)
    rdzv.ensure_config({"nnodes": "1:3", "entrypoint": "train.py"})
    rdzv.register()
    return rdzv


def next_rounds(nodes: List[Rendezvous], timeout: float = 20.0) -> Dict[str, Topology]:
    """``next_round()`` on every node at once (as their agents do); the round each one got."""
    got: Dict[str, Topology] = {}
    errors: List[BaseException] = []

    def one(r: Rendezvous) -> None:
        try:
            got[r.node_id] = r.next_round()
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    assert len(got) == len(nodes), f"only {sorted(got)} got a round within {timeout}s"
    return got


def seen(r: Rendezvous, fn, timeout: float = 5.0):
    """``fn()`` once ``r``'s view (fed by the store's watch, on its own thread) makes it truthy."""
    deadline = time.monotonic() + timeout
    while True:
        version = r.view.version
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        r.view.wait_change(version, 0.05)
