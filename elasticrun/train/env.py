"""What the launcher tells a worker: ranks, round and the rescale that started it.

:class:`ElasticState` is read from the environment (torchrun's variables plus
``ELASTICRUN_*``) and the rescale-event JSON file the agent writes for every round. It
works the same under ``elasticrun``, plain ``torchrun`` (no rescale info: the round is
``TORCHELASTIC_RESTART_COUNT``) and a plain ``python train.py`` (world 1).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from elasticrun.errors import ConfigError
from elasticrun.job import env as job_env
from elasticrun.rendezvous.records import RescaleEvent, RescaleType

log = logging.getLogger(__name__)

#: The variable that holds the launcher's ``--checkpoint-dir`` (spelled in elasticrun.job.env), for
#: training scripts: ``os.environ.get(elasticrun.train.env.ENV_CHECKPOINT_DIR)``.
ENV_CHECKPOINT_DIR = job_env.CHECKPOINT_DIR


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class ElasticState:
    """The worker's place in the job and why this round exists.

    ``prev_world_size`` is 0 on the job's first round (and whenever the launcher gave no
    rescale information, e.g. under plain torchrun), so ``world_changed`` is False there.
    """

    rank: int = 0
    local_rank: int = 0  # LOCAL_RANK: the GPU to use (0 in every worker with --virtual-local-rank)
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    round: int = 0
    restart_count: int = 0
    prev_world_size: int = 0
    rescale_type: RescaleType = RescaleType.START
    event: Optional[RescaleEvent] = None
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    node_id: str = ""
    launched: bool = False  # started by elasticrun or torchrun (RANK/WORLD_SIZE set)
    elastic: bool = False  # started by elasticrun (ELASTICRUN_ROUND set)
    extra: Dict[str, Any] = field(default_factory=dict)
    node_local_rank: Optional[int] = None  # the worker's index on its node (ELASTICRUN_LOCAL_RANK); None: local_rank

    @property
    def world_changed(self) -> bool:
        """True when this round runs at a different world size than the previous one."""
        return self.prev_world_size > 0 and self.prev_world_size != self.world_size

    @property
    def job_id(self) -> str:
        """The job id (``--rdzv-id``); :attr:`rdzv_id` is its older name."""
        return self.rdzv_id

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def is_local_rank0(self) -> bool:
        """The node's first worker (with ``--virtual-local-rank`` too, where every LOCAL_RANK is 0)."""
        return (self.local_rank if self.node_local_rank is None else self.node_local_rank) == 0

    @property
    def progress_id(self) -> str:
        """Name under which this node reports progress (the agent's node id, else host-based)."""
        return self.node_id or f"group{self.group_rank}"

    def describe(self) -> str:
        """One line for logs, e.g. ``round 3 ScaleDown world 4->3 rank 0/3``."""
        prev = f"{self.prev_world_size}->" if self.prev_world_size else ""
        return (
            f"round {self.round} {self.rescale_type.value} world {prev}{self.world_size} "
            f"rank {self.rank}/{self.world_size} restarts {self.restart_count}"
        )

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> ElasticState:
        """Read the worker environment (``os.environ`` by default) and the rescale event file.

        A missing or unreadable event file is not an error (it only adds detail): a
        warning is logged and the plain variables are used.
        """
        env = os.environ if env is None else env
        launched = job_env.RANK in env and job_env.WORLD_SIZE in env
        elastic = bool(env.get(job_env.ROUND, "").strip())
        rank = _int(env, job_env.RANK, 0)
        world = _int(env, job_env.WORLD_SIZE, 1)
        local_rank = _int(env, job_env.LOCAL_RANK, 0)
        local_world = _int(env, job_env.LOCAL_WORLD_SIZE, 1)
        if world < 1:
            raise ConfigError(f"WORLD_SIZE={world} must be at least 1")
        if not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world})")
        restarts = _int(env, job_env.RESTART_COUNT, 0)
        rnd = _int(env, job_env.ROUND, restarts)
        prev = _int(env, job_env.PREV_WORLD_SIZE, 0)
        raw_type = env.get(job_env.RESCALE_TYPE, "").strip()
        if raw_type:
            try:
                rtype = RescaleType(raw_type)
            except ValueError:
                names = ", ".join(t.value for t in RescaleType)
                raise ConfigError(f"{job_env.RESCALE_TYPE}={raw_type!r} is not one of {names}") from None
        else:
            rtype = RescaleType.RESTART if restarts > 0 else RescaleType.START
        event = _read_event(env.get(job_env.RESCALE_EVENT_FILE, ""))
        if event is not None:
            if not raw_type:
                rtype = event.type
            if not prev and event.old_world_size:
                prev = event.old_world_size
        return cls(
            rank=rank,
            local_rank=local_rank,
            node_local_rank=_int(env, job_env.NODE_LOCAL_RANK, local_rank) if job_env.NODE_LOCAL_RANK in env else None,
            world_size=world,
            local_world_size=local_world,
            group_rank=_int(env, job_env.GROUP_RANK, 0),
            round=rnd,
            restart_count=restarts,
            prev_world_size=prev,
            rescale_type=rtype,
            event=event,
            rdzv_endpoint=env.get(job_env.RDZV_ENDPOINT, "").strip(),
            rdzv_id=env.get(job_env.RDZV_ID, "").strip() or env.get(job_env.RUN_ID, "").strip(),
            node_id=env.get(job_env.NODE_ID, "").strip(),
            launched=launched,
            elastic=elastic,
        )


def _read_event(path: str) -> Optional[RescaleEvent]:
    path = path.strip()
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        # The agent writes {} when the round has no rescale event (the job's first round).
        return RescaleEvent.from_dict(data) if data else None
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("ignoring rescale event file %s: %s", path, err)
        return None


__all__ = ["ElasticState", "ENV_CHECKPOINT_DIR"]
