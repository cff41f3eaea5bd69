"""The job's contract: what the agent, the workers and the CLI must agree on.

- :mod:`~elasticrun.job.keys`: the etcd key layout under ``/elasticrun/<job_id>/``;
- :mod:`~elasticrun.job.env`: every environment variable the agent writes and workers read;
- :mod:`~elasticrun.job.settings`: :class:`EtcdSettings`, how every process reaches etcd;
- :mod:`~elasticrun.job.fence`: the checkpoint-commit fence;
- :mod:`~elasticrun.job.requests`: the checkpoint-request protocol;
- :mod:`~elasticrun.job.shm`: the layout of a node's memory tier in shared memory.

Nothing outside this package builds an etcd key, spells an ``ELASTICRUN_*`` name or a
snapshot directory's layout.
The bottom layer with ``errors`` and ``proc``: every package may import it; it imports only
``errors`` (and ``EtcdSettings.connect`` opens a :mod:`elasticrun.store` client, the one
exception in tests/test_layering.py). See the package map in docs/design.md.
"""

from __future__ import annotations

from elasticrun.job import env
from elasticrun.job.keys import ROOT, JobKeys, job_of
from elasticrun.job.settings import EtcdSettings

__all__ = ["ROOT", "EtcdSettings", "JobKeys", "env", "job_of"]
