"""The layout of a node's memory tier in shared memory: what the agent, workers and CLI agree on.

Every agent owns one snapshot directory (``ELASTICRUN_SNAPSHOT_DIR``)::

    /dev/shm/elasticrun-snap-<job>-<node hash>-<agent pid>/
        owner           the agent's pid and start time (informational)
        lock            flocked by the agent while it lives (the sweep's liveness test)
        generations/    committed memory generations (a checkpoint root in the disk format)
        replicas/       copies of the ring predecessor node's parts of its generations
        restore/        a restore's view of one generation: local hard links plus fetched parts
        outgoing/       hard links pinning a generation while its replica is sent
        persist/        hard links pinning a generation while it is copied to disk
        failed-restores names of generations whose restore failed (one a line; never tried again)

This module is the only place that spells these names and states the rule of a root's name
(:func:`root_name` makes one, :func:`parse_root_name` recognises one: the agents' sweep of dead
roots and ``elasticrun ckpt list --memory`` use it); ``generations/`` and ``replicas/`` hold
checkpoints, the other three are transient (a new worker removes what a dead one left).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from elasticrun.job import env as env_names

#: Where snapshot directories live (a tmpfs on Linux).
SHM_DIR = "/dev/shm"
#: Every snapshot directory's name starts with this.
PREFIX = "elasticrun-snap-"
#: The file in a snapshot directory naming the agent that owns it.
OWNER_FILE = "owner"
#: The file in a snapshot directory the owning agent holds an exclusive flock on for its lifetime.
LOCK_FILE = "lock"

#: The file in a snapshot directory listing the generations whose restore failed.
FAILED_RESTORES_FILE = "failed-restores"

GENERATIONS = "generations"
REPLICAS = "replicas"
RESTORE = "restore"
OUTGOING = "outgoing"
PERSIST = "persist"

#: Subdirectories that hold checkpoints, and what one of their entries is.
KINDS: Dict[str, str] = {GENERATIONS: "generation", REPLICAS: "replica"}
#: Subdirectories whose content only lives while a worker uses it.
TRANSIENT: Tuple[str, ...] = (PERSIST, OUTGOING, RESTORE)

_DIR_RE = re.compile(r"^" + re.escape(PREFIX) + r"(?P<job>.+)-(?P<node>[0-9a-f]{8})-(?P<pid>\d+)$")


def job_part(job_id: str) -> str:
    """How a snapshot directory's name spells ``job_id`` (sanitised, at most 40 characters)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", job_id)[:40] or "job"


def root_name(job_id: str, node_id: str, pid: int) -> str:
    """``elasticrun-snap-<job>-<hash of node id>-<pid>``: job id sanitised, short, unique per agent."""
    node = hashlib.sha256(node_id.encode()).hexdigest()[:8]
    return f"{PREFIX}{job_part(job_id)}-{node}-{pid}"


def parse_root_name(name: str) -> Optional[Tuple[str, str, int]]:
    """``(job part, node hash, agent pid)`` of a snapshot directory's name, or None if it is not one."""
    m = _DIR_RE.match(name)
    return None if m is None else (m.group("job"), m.group("node"), int(m.group("pid")))


def snapshot_dir() -> Optional[str]:
    """This process's snapshot directory (``ELASTICRUN_SNAPSHOT_DIR``), or None outside elasticrun."""
    path = os.environ.get(env_names.SNAPSHOT_DIR)
    return path if path and os.path.isdir(path) else None


def generations_root(base: Optional[str] = None) -> Optional[str]:
    """The checkpoint root of the memory tier (inside ``base``, default :func:`snapshot_dir`)."""
    base = base or snapshot_dir()
    return None if base is None else os.path.join(base, GENERATIONS)


@dataclass(frozen=True)
class ShmLayout:
    """The paths inside one snapshot directory ``base``."""

    base: str

    @property
    def generations(self) -> str:
        return os.path.join(self.base, GENERATIONS)

    @property
    def replicas(self) -> str:
        return os.path.join(self.base, REPLICAS)

    @property
    def restore(self) -> str:
        return os.path.join(self.base, RESTORE)

    @property
    def outgoing(self) -> str:
        return os.path.join(self.base, OUTGOING)

    @property
    def persist(self) -> str:
        return os.path.join(self.base, PERSIST)

    @property
    def failed_restores(self) -> str:
        return os.path.join(self.base, FAILED_RESTORES_FILE)

    @property
    def owner(self) -> str:
        return os.path.join(self.base, OWNER_FILE)


__all__ = ["FAILED_RESTORES_FILE", "GENERATIONS", "KINDS",
           "OUTGOING", "OWNER_FILE", "PERSIST", "PREFIX", "REPLICAS", "RESTORE", "SHM_DIR",
           "TRANSIENT", "ShmLayout", "generations_root", "job_part", "parse_root_name", "root_name", "snapshot_dir"]
