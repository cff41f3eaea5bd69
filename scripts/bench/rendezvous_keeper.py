"""Child of a ``rendezvous_agents.py`` shard: sends the shard's lease keep-alives from a process of its own.

On a real cluster each agent's keep-alive thread shares its machine with one agent. Here hundreds of
simulated agents share a process and 2 cores: a keep-alive answer that has to wait for the
process's GIL behind hundreds of busy agent threads, once per lease, turned a batch into seconds and
the leases expired although etcd had answered in time. So the shard's refresher hands each batch
to this process (one line in, one line out: two wake-ups per batch, not two per lease), which runs
the real ``EtcdStore.refresh_leases`` at normal priority while the agents run at the lowest.

Protocol, one JSON line each way: ``{"ids": [...], "timeout": T}`` -> ``{"answers": {id: ttl}}``
or ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict


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
