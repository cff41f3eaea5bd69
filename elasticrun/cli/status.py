"""``elasticrun status``: the live view of a job (or the list of jobs) in etcd."""

from __future__ import annotations

HELP = "Show a job's round, members, ranks and recent rescale events."


def status() -> None:  # replaced by the full implementation
    pass
