"""The environment of one worker: torchrun's variables plus ELASTICRUN_* ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional

from elasticrun.models import Member, RescaleEvent, Topology


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
) -> Dict[str, str]:
    """Build the environment for ``spec``'s worker from ``base`` (normally ``os.environ``)."""
    topo, member = spec.topology, spec.member
    env = dict(base)
    env.update(
        {
            "LOCAL_RANK": str(spec.local_rank),
            "RANK": str(spec.rank),
            "GROUP_RANK": str(member.group_rank),
            "ROLE_RANK": str(spec.rank),
            "ROLE_NAME": role,
            "LOCAL_WORLD_SIZE": str(member.nproc),
            "WORLD_SIZE": str(topo.world_size),
            "GROUP_WORLD_SIZE": str(len(topo.members)),
            "ROLE_WORLD_SIZE": str(topo.world_size),
            "MASTER_ADDR": topo.master_addr,
            "MASTER_PORT": str(topo.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(topo.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_ERROR_FILE": spec.error_file,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "ELASTICRUN_ROUND": str(topo.round),
            "ELASTICRUN_PREV_WORLD_SIZE": str(event.old_world_size if event else 0),
            "ELASTICRUN_RESCALE_TYPE": event.type.value if event else "Start",
            "ELASTICRUN_RESCALE_EVENT_FILE": spec.event_file,
            "ELASTICRUN_RDZV_ENDPOINT": rdzv_endpoint,
            "ELASTICRUN_RDZV_ID": run_id,
            "ELASTICRUN_NODE_ID": node_id,
            "ELASTICRUN_BACKEND": backend or ("nccl" if use_gpu else "gloo"),
        }
    )
    env.update(extra or {})
    if member.nproc > 1 and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = "1"
    # Output goes through a pipe to be prefixed: keep it line-buffered like a terminal.
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env

