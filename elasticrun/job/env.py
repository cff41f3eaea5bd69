"""Every environment variable name the agent writes and workers (or the CLI) read.

This module is the only place that spells an ``ELASTICRUN_*`` name; the torchrun names
the agent sets are listed here too, so one file shows the whole worker environment.
Secrets never travel in the environment: the etcd connection settings (with the
password, if any) reach workers through a 0600 file named by :data:`ETCD_SETTINGS_FILE`,
and the agent removes :data:`SECRET_NAMES` from the environment it gives workers.
"""

from __future__ import annotations

from typing import Dict, Mapping

PREFIX = "ELASTICRUN_"

# -- torchrun's worker variables (set by the agent, read by torch and elasticrun.train) --------
LOCAL_RANK = "LOCAL_RANK"
RANK = "RANK"
GROUP_RANK = "GROUP_RANK"
ROLE_RANK = "ROLE_RANK"
ROLE_NAME = "ROLE_NAME"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
WORLD_SIZE = "WORLD_SIZE"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
RUN_ID = "TORCHELASTIC_RUN_ID"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
LOG_LINE_PREFIX_TEMPLATE = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"  # read by the agent: worker output prefix

# -- elasticrun's worker variables (set by the agent) ------------------------------------------
ROUND = PREFIX + "ROUND"  # the rendezvous round this worker belongs to (the commit fence)
#: The worker's index on its node (0..LOCAL_WORLD_SIZE-1), always: with ``--virtual-local-rank``
#: LOCAL_RANK is 0 in every worker, and this still tells the node's first worker from the others.
NODE_LOCAL_RANK = PREFIX + "LOCAL_RANK"
PREV_WORLD_SIZE = PREFIX + "PREV_WORLD_SIZE"
RESCALE_TYPE = PREFIX + "RESCALE_TYPE"
RESCALE_EVENT_FILE = PREFIX + "RESCALE_EVENT_FILE"
RDZV_ENDPOINT = PREFIX + "RDZV_ENDPOINT"  # the job's etcd endpoints
RDZV_ID = PREFIX + "RDZV_ID"  # the job id (``--rdzv-id``)
NODE_ID = PREFIX + "NODE_ID"
BACKEND = PREFIX + "BACKEND"
LR_SCALING = PREFIX + "LR_SCALING"
REDISTRIBUTION = PREFIX + "REDISTRIBUTION"
#: ``--global-batch-size``: the global batch elasticrun.train keeps at any world size (0/unset: none).
GLOBAL_BATCH_SIZE = PREFIX + "GLOBAL_BATCH_SIZE"
#: Path of the 0600 JSON file with the job's :class:`~elasticrun.job.settings.EtcdSettings`.
ETCD_SETTINGS_FILE = PREFIX + "ETCD_SETTINGS_FILE"
#: The node's memory tier: a 0700 shared-memory directory the agent owns (see elasticrun.launch.shmroot).
SNAPSHOT_DIR = PREFIX + "SNAPSHOT_DIR"
#: In-place re-forming (see elasticrun.train.inplace): this worker's assignment file. The agent
#: writes the next round's ranks there (write + rename) instead of restarting the worker; a worker
#: opts in by creating ``<file>.optin``. Unset: the worker is always restarted (the restart path).
INPLACE_FILE = PREFIX + "INPLACE_FILE"
#: ``1`` on a newcomer joining a group that re-forms in place: it receives the state by broadcast.
INPLACE_JOIN = PREFIX + "INPLACE_JOIN"
#: A node-local file (the agent's, kept across rounds) where the node's progress reporter keeps
#: ``<round> <step>`` of its latest report: the next round's reporter tells the agent how far the
#: previous round got, for the steps a rollback loses (see elasticrun.train.progress).
PROGRESS_FILE = PREFIX + "PROGRESS_FILE"
#: A node-local directory (the agent's) where each worker's StepTimer keeps ``<round> <rank> <seconds>``:
#: its mean compute seconds per step; the node's progress reporter sends every rank's to etcd.
STEP_TIMES_DIR = PREFIX + "STEP_TIMES_DIR"

# -- read from the user's environment ----------------------------------------------------------
#: Default checkpoint root of examples/train.py (set by the user; the agent never sets it).
CHECKPOINT_DIR = PREFIX + "CHECKPOINT_DIR"
ETCD_BINARY = PREFIX + "ETCD_BINARY"
#: History an etcd started by elasticrun keeps (auto-compaction): ``5m`` (default), ``1h``, ``10000rev``.
ETCD_COMPACTION_RETENTION = PREFIX + "ETCD_COMPACTION_RETENTION"
ETCD_TIMEOUT = PREFIX + "ETCD_TIMEOUT"
ETCD_USER = PREFIX + "ETCD_USER"
#: The etcd password (``--etcd-password-file`` is the other safe way to give it).
ETCD_PASSWORD = PREFIX + "ETCD_PASSWORD"
ETCD_PASSWORD_FILE = PREFIX + "ETCD_PASSWORD_FILE"
ETCD_CACERT = PREFIX + "ETCD_CACERT"
ETCD_CERT = PREFIX + "ETCD_CERT"
ETCD_KEY = PREFIX + "ETCD_KEY"
CKPT_RETRIES = PREFIX + "CKPT_RETRIES"
#: Memory-tier cap per node for ``elasticrun.checkpoint.snapshot`` (bytes, or e.g. ``8G``; unset: /dev/shm's size).
SNAPSHOT_MEMORY = PREFIX + "SNAPSHOT_MEMORY"
#: Seconds a peer-replica transfer of a memory snapshot waits for its peer (default 300).
SNAPSHOT_REPLICA_TIMEOUT = PREFIX + "SNAPSHOT_REPLICA_TIMEOUT"
#: ``--metrics-port``: the agent's /metrics port (0: off).
METRICS_PORT = PREFIX + "METRICS_PORT"
#: ``--metrics-host``: the address /metrics listens on (default 127.0.0.1).
METRICS_HOST = PREFIX + "METRICS_HOST"
#: ``--events-file``: the agent's JSON-lines event log.
EVENTS_FILE = PREFIX + "EVENTS_FILE"
#: Tests only: ``<phase>[:<rank>]`` at which a checkpoint commit SIGKILLs its process.
CKPT_CRASH_AT = PREFIX + "CKPT_CRASH_AT"
#: ``--hang-timeout``: seconds without progress before a round counts as hung (0/unset: off).
HANG_TIMEOUT = PREFIX + "HANG_TIMEOUT"
#: ``1``: the fork server imports torch as it starts and the first round's workers wait for it; ``0``: never
#: (they import torch themselves); unset or ``auto``: when the host has fewer usable cores than the node's
#: workers + 2 (see elasticrun.launch.preload).
PRELOAD_FIRST = PREFIX + "PRELOAD_FIRST"
#: Example only: print per-step timing.
EXAMPLE_TIMING = PREFIX + "EXAMPLE_TIMING"

#: Names that may hold a secret: never passed on to workers.
SECRET_NAMES = (ETCD_PASSWORD,)


def without_secrets(env: Mapping[str, str]) -> Dict[str, str]:
    """A copy of ``env`` without :data:`SECRET_NAMES` (what a worker may inherit)."""
    return {k: v for k, v in env.items() if k not in SECRET_NAMES}


__all__ = [n for n in dir() if n.isupper()] + ["without_secrets"]
