"""The job's contract: what the agent, the workers and the CLI must agree on.

- :mod:`~elasticrun.job.keys`: the etcd key layout under ``/elasticrun/<job_id>/``;
- :mod:`~elasticrun.job.env`: every environment variable the agent writes and workers read;
- :mod:`~elasticrun.job.settings`: how the etcd settings travel (the password's sources, the
  workers' 0600 settings file);
- :mod:`~elasticrun.job.records`: the records read from etcd and their checks;
- :mod:`~elasticrun.job.fence`: the checkpoint-commit fence's rule;
- :mod:`~elasticrun.job.requests`: the checkpoint-request protocol's keys and records;
- :mod:`~elasticrun.job.inplace`: the files an agent and its workers share to re-form in place;
- :mod:`~elasticrun.job.shm`: the layout of a node's memory tier in shared memory.

Nothing outside this package builds an etcd key, spells an ``ELASTICRUN_*`` name or a
snapshot directory's layout. A pure contract: names, layouts, formats and their checks; no
module here calls etcd (that is done where the contract is used). It imports ``errors`` and
the plain types of :mod:`elasticrun.store` (``EtcdSettings``). See the package map in
docs/design.md.
"""

from __future__ import annotations

from elasticrun.job import env
from elasticrun.job.keys import ROOT, JobKeys, job_of

__all__ = ["ROOT", "JobKeys", "env", "job_of"]
