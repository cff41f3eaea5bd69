"""The environment of one worker: torchrun's variables plus ELASTICRUN_* ones.

The names come from :mod:`elasticrun.job.env`. Secrets (the etcd password) are removed
from the inherited environment; a worker reaches etcd through the 0600 settings file the
agent names in ``ELASTICRUN_ETCD_SETTINGS_FILE``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional

from elasticrun.job import env as names
from elasticrun.launch.gpus import VISIBLE_DEVICES, virtual_visible_device
from elasticrun.rendezvous.records import Member, RescaleEvent, Topology


@dataclass(frozen=True)
class WorkerSpec:
    """Where one worker sits in a round."""

    topology: Topology
    member: Member
    local_rank: int
    error_file: str
    event_file: str

    @property
    def rank(self) -> int:
        return self.member.rank_offset + self.local_rank


def worker_env(
    base: Mapping[str, str],
    spec: WorkerSpec,
    *,
    run_id: str,
    max_restarts: int,
    rdzv_endpoint: str,
    node_id: str,
    role: str = "default",
    event: Optional[RescaleEvent] = None,
    backend: Optional[str] = None,
    use_gpu: bool = False,
    extra: Optional[Mapping[str, str]] = None,
    etcd_settings_file: Optional[str] = None,
    virtual_local_rank: bool = False,
) -> Dict[str, str]:
    """Build the environment for ``spec``'s worker from ``base`` (normally ``os.environ``).

    ``run_id`` is the job id; ``etcd_settings_file`` the agent's 0600 file of
    :class:`~elasticrun.job.settings.EtcdSettings` (needed when etcd uses TLS or auth).
    ``virtual_local_rank`` (torchrun's ``--virtual-local-rank``): LOCAL_RANK is 0 and
    ``CUDA_VISIBLE_DEVICES`` names only the worker's own GPU (:func:`virtual_visible_device`).
    """
    topo, member = spec.topology, spec.member
    env = names.without_secrets(base)
    env.update(
        {
            names.LOCAL_RANK: "0" if virtual_local_rank else str(spec.local_rank),
            names.NODE_LOCAL_RANK: str(spec.local_rank),
            names.RANK: str(spec.rank),
            names.GROUP_RANK: str(member.group_rank),
            names.ROLE_RANK: str(spec.rank),
            names.ROLE_NAME: role,
            names.LOCAL_WORLD_SIZE: str(member.nproc),
            names.WORLD_SIZE: str(topo.world_size),
            names.GROUP_WORLD_SIZE: str(len(topo.members)),
            names.ROLE_WORLD_SIZE: str(topo.world_size),
            names.MASTER_ADDR: topo.master_addr,
            names.MASTER_PORT: str(topo.master_port),
            names.RESTART_COUNT: str(topo.restart_count),
            names.MAX_RESTARTS: str(max_restarts),
            names.RUN_ID: run_id,
            names.USE_AGENT_STORE: "True",
            names.ERROR_FILE: spec.error_file,
            names.NCCL_ASYNC_ERROR_HANDLING: base.get(names.NCCL_ASYNC_ERROR_HANDLING, "1"),
            names.ROUND: str(topo.round),
            names.PREV_WORLD_SIZE: str(event.old_world_size if event else 0),
            names.RESCALE_TYPE: event.type.value if event else "Start",
            names.RESCALE_EVENT_FILE: spec.event_file,
            names.RDZV_ENDPOINT: rdzv_endpoint,
            names.RDZV_ID: run_id,
            names.NODE_ID: node_id,
            names.BACKEND: backend or ("nccl" if use_gpu else "gloo"),
        }
    )
    if virtual_local_rank:
        env[VISIBLE_DEVICES] = virtual_visible_device(spec.local_rank, base.get(VISIBLE_DEVICES))
    if etcd_settings_file:
        env[names.ETCD_SETTINGS_FILE] = etcd_settings_file
    else:
        env.pop(names.ETCD_SETTINGS_FILE, None)
    env.pop(names.SNAPSHOT_DIR, None)  # only this agent's own memory tier (in ``extra``), never an inherited one
    env.update(extra or {})
    if member.nproc > 1 and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = "1"
    # Output goes through a pipe to be prefixed: keep it line-buffered like a terminal.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
