"""Old home of the job's etcd key layout: now :mod:`elasticrun.job.keys` (re-exported here)."""

from __future__ import annotations

from elasticrun.job.keys import ROOT, JobKeys, job_of

__all__ = ["ROOT", "JobKeys", "job_of"]
