"""Exceptions that carry a one-line, user-facing message.

The CLI prints ``str(err)`` of an :class:`ElasticrunError` as a single line and exits with
``err.exit_code``; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ElasticrunError(Exception):
    """Base for errors that are the user's to fix: the message says what and how."""

    exit_code: int = 2


class ConfigError(ElasticrunError):
    """Invalid flags or settings."""


class StoreError(ElasticrunError):
    """etcd is unreachable, refused us, or answered something unexpected."""

    exit_code = 3


class StoreFullError(StoreError):
    """etcd's database reached its quota (the NOSPACE alarm): it refuses writes until an operator
    compacts, defragments and disarms it."""


class RendezvousError(ElasticrunError):
    """The job could not form (or re-form) a round."""

    exit_code = 4


class JobFailedError(ElasticrunError):
    """Workers failed and the restarts ran out."""

    exit_code = 1


class CheckpointError(ElasticrunError):
    """A checkpoint could not be saved, found, read or verified."""

    exit_code = 5
