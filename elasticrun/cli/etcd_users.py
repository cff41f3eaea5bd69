"""A user per job: ``elasticrun etcd --job-user JOB:FILE`` gives job JOB a user limited to its keys.

The user gets one role, ``elasticrun-<job_id>``, with read/write on the job's prefix
(:attr:`~elasticrun.job.keys.JobKeys.prefix`) and nothing else: it cannot read or change any
other job (docs/security.md).
"""

from __future__ import annotations

from elasticrun.job.keys import JobKeys
from elasticrun.store.admin import add_prefix_user
from elasticrun.store.client import EtcdStore


def job_role(job_id: str) -> str:
    """Name of the role that may read and write job ``job_id``'s keys."""
    return f"elasticrun-{job_id}"


def add_job_user(store: EtcdStore, user: str, password: str, job_id: str) -> None:
    """Create ``user`` with a role limited to job ``job_id``'s prefix (``store`` must be root)."""
    add_prefix_user(store, user, password, job_role(job_id), JobKeys(job_id).prefix)


__all__ = ["add_job_user", "job_role"]
