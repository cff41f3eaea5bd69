"""Fencing of checkpoint commits: a worker of a stale round never publishes a checkpoint.

Under elasticrun every worker knows its round (``ELASTICRUN_ROUND``) and the job's etcd
(``ELASTICRUN_RDZV_ENDPOINT``, ``ELASTICRUN_RDZV_ID``). Right before the commit marker is
written, the committing rank reads the job's current round from etcd; if a newer round
exists (this worker's node was presumed dead, e.g. frozen past its lease) or etcd cannot
confirm it, the save is refused and rolled back. Outside elasticrun this is a no-op.
"""

from __future__ import annotations

import os

from elasticrun.errors import CheckpointError, ElasticrunError

ROUND_ENV = "ELASTICRUN_ROUND"


def check_round_is_current() -> None:
    """Raise CheckpointError unless this worker's round is still the job's current round."""
    endpoint = os.environ.get("ELASTICRUN_RDZV_ENDPOINT")
    job = os.environ.get("ELASTICRUN_RDZV_ID")
    mine = os.environ.get(ROUND_ENV)
    if not (endpoint and job and mine):
        return
    from elasticrun.rendezvous.keys import JobKeys
    from elasticrun.store.client import connect

    try:
        with connect(endpoint, retry_timeout=3.0, timeout=3.0) as store:
            topo = store.get_json(JobKeys(job).topology)
    except ElasticrunError as err:
        raise CheckpointError(f"cannot confirm that round {mine} is still current ({err}); not committing") from None
    current = None if topo is None else int(topo.get("round", -1))
    if current != int(mine):
        raise CheckpointError(
            f"this worker belongs to round {mine} but the job is at round {current}: a stale round must not "
            "commit a checkpoint (its node lost its lease); not committing"
        )
