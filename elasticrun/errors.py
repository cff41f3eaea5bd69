"""Exceptions that carry a one-line, user-facing message.

The CLI prints ``str(err)`` of an :class:`ElasticrunError` as a single line and exits with the
code :func:`elasticrun.job.exitcodes.for_error` gives it (the one exit-code table); anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

from typing import Optional


class ElasticrunError(Exception):
    """Base for errors that are the user's to fix: the message says what and how."""

    exit_code: Optional[int] = None  # None: the class's row of elasticrun.job.exitcodes; set to override


class ConfigError(ElasticrunError):
    """Invalid flags or settings."""


class StoreError(ElasticrunError):
    """etcd is unreachable or answered something unexpected: transient, a retry may succeed."""


class StoreSetupError(StoreError):
    """etcd settings are wrong (endpoint, certificates, credentials, permissions): no retry helps."""


class StoreFullError(StoreError):
    """etcd's database reached its quota (the NOSPACE alarm): it refuses writes until an operator
    compacts, defragments and disarms it."""


class LeaseGoneError(StoreError):
    """etcd refused a write under a lease it no longer knows (``requested lease not found``): the lease
    expired or was revoked before the write reached etcd. Take a new lease and write again."""


class RendezvousError(ElasticrunError):
    """The job could not form (or re-form) a round (nodes may still come: transient)."""


class JobFailedError(ElasticrunError):
    """Workers failed and the restarts ran out (or the job ended for another reason, see exit_code)."""


class CheckpointError(ElasticrunError):
    """A checkpoint could not be saved, found, read or verified."""
