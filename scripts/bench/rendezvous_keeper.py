"""Child of a ``rendezvous_agents.py`` shard: sends the shard's lease keep-alives from a process of its own.

On a real cluster each agent's keep-alive thread shares its machine with one agent. Here hundreds of
simulated agents share a process and 2 cores: a keep-alive answer that has to wait for the
process's GIL behind hundreds of busy agent threads, once per lease, turned a batch into seconds and
the leases expired although etcd had answered in time. So the shard's refresher hands each batch
to this process (one line in, one line out: two wake-ups per batch, not two per lease), which runs
the real ``EtcdStore.refresh_leases`` at normal priority while the agents run at the lowest.

``Keeper`` is the shard's side (it starts this file as a process); ``main`` is the process.
Protocol, one JSON line each way: ``{"ids": [...], "timeout": T}`` -> ``{"answers": {id: ttl}}``
or ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from typing import Any, Dict


class Keeper:
    """The shard's keep-alive process (``rendezvous_keeper.py``): ``refresh`` is ``refresh_leases`` there."""

    def __init__(self, endpoint: str) -> None:
        self.lock = threading.Lock()
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), endpoint], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
            raise RuntimeError("the keep-alive process failed to start")

    def refresh(self, ids: Any, timeout: Any = None) -> Dict[int, int]:
        from elasticrun.errors import StoreError

        request = json.dumps({"ids": [int(i) for i in ids], "timeout": timeout}) + "\n"
        with self.lock:  # one batch at a time (with --clients agent, every agent's refresher calls here)
            try:
                self.proc.stdin.write(request)  # type: ignore[union-attr]
                self.proc.stdin.flush()  # type: ignore[union-attr]
                reply = self.proc.stdout.readline()  # type: ignore[union-attr]
            except (OSError, ValueError):  # closed at the end of the bench
                reply = ""
        if not reply:
            raise StoreError("the bench's keep-alive process died")
        out = json.loads(reply)
        if "error" in out:
            raise StoreError(out["error"])
        return {int(k): int(v) for k, v in out["answers"].items()}

    def close(self) -> None:
        try:
            with self.lock:
                self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def main(endpoint: str) -> None:
    from elasticrun.errors import StoreError
    from elasticrun.store.client import connect

    store = connect(endpoint, retry_timeout=60)
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        out: Dict[str, Any]
        try:
            answers = store.refresh_leases([int(i) for i in req["ids"]], req.get("timeout"))
            out = {"answers": {str(k): int(v) for k, v in answers.items()}}
        except StoreError as err:
            out = {"error": str(err)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
