"""In-place re-forming: the files an agent and its workers share (see :mod:`elasticrun.train.inplace`).

Per local worker the agent names a file in ``ELASTICRUN_INPLACE_FILE``. The agent writes the next
round's assignment there (write + rename); the worker writes ``<file>.optin`` (the round it runs
in: it opted in, and re-formed for that round) and, as a newcomer, ``<file>.ready`` just before it
joins the group (its start-up is over: the survivors may re-form now). When the agent keeps its
workers through a round change it writes ``<file>.recover`` (:func:`announce_recovery`): a worker
whose collective broke (a peer crashed) waits for its next assignment instead of exiting; when the
round's end broke its collectives (a crash, a lost node: :func:`collectives_broken`), an NCCL worker
aborts its communicators at once (its kernels would wait on the dead peer for torch's timeout).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional

from elasticrun.job import env as names

EXIT_INPLACE_FAILED = 75  # the worker could not re-form: the agent takes the restart path
#: Default of ``--inplace-ready-timeout``: newcomers' start-up (interpreter, imports, model, up to
#: ``init_process_group``) while the survivors keep training at the old size.
READY_WAIT_S = 300.0
INPLACE_DEADLINE_S = 60.0  # assignment written → every local worker re-formed
#: A failure row's flag (``rounds/<n>/failures/<node>``): the worker failed inside its node's in-place
#: re-form (a survivor between its assignment and re-forming, a newcomer before it received the state).
DURING_INPLACE = "during_inplace"
#: A failure row's flag: the worker failed while its node's workers had all opted in and no re-form was
#: under way, so the survivors may recover in place (the failed node's workers rejoin as newcomers).
RECOVERABLE = "recoverable_in_place"

#: The variables an assignment carries (the rest of the environment stays as it was).
ASSIGNED = (
    names.RANK, names.WORLD_SIZE, names.LOCAL_RANK, names.LOCAL_WORLD_SIZE, names.GROUP_RANK,
    names.GROUP_WORLD_SIZE, names.ROLE_RANK, names.ROLE_WORLD_SIZE, names.MASTER_ADDR, names.MASTER_PORT,
    names.RESTART_COUNT, names.ROUND, names.PREV_WORLD_SIZE, names.RESCALE_TYPE, names.RESCALE_EVENT_FILE,
)


def write_assignment(path: str, env: Mapping[str, str], leave: bool = False) -> None:
    """Agent side: atomically publish a worker's next assignment (``env``: the new worker variables)."""
    body = {"round": int(env.get(names.ROUND, "-1")), "leave": leave,
            "env": {k: str(env[k]) for k in ASSIGNED if k in env}}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(body, f)
    os.replace(tmp, path)


def read_assignment(path: str) -> Optional[Dict[str, Any]]:
    """The assignment at ``path``, or None (absent or not yet complete)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def opted_in(path: str) -> bool:
    """Agent side: True once the worker whose assignment file is ``path`` opted in."""
    return os.path.exists(path + ".optin")


def formed_round(path: str) -> int:
    """Agent side: the round the worker whose assignment file is ``path`` last (re-)formed for (-1: none)."""
    try:
        with open(path + ".optin") as f:
            return int(f.read().strip() or -1)
    except (OSError, ValueError):
        return -1


def announce_recovery(path: str, round_: int, wait_s: float, broken: bool = False) -> None:
    """Agent side: the workers of round ``round_`` are kept through its end: a worker whose collective
    broke waits up to ``wait_s`` for its next assignment (the replacement's start-up) instead of exiting.
    ``broken``: the round ended by a crash or a lost node, so its collectives cannot complete (False: a
    planned join or graceful leave, where the workers train on until their assignment)."""
    tmp = f"{path}.recover.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"round": int(round_), "wait_s": float(wait_s), "broken": bool(broken)}, f)
    os.replace(tmp, path + ".recover")


def recovery_announced(path: str, round_: int) -> Optional[float]:
    """Worker side: how long to wait for the next assignment when the agent keeps the workers of
    round ``round_`` (None: not announced, or for another round)."""
    try:
        with open(path + ".recover") as f:
            body = json.load(f)
        if int(body["round"]) == round_:
            return float(body["wait_s"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def collectives_broken(path: str, round_: int) -> bool:
    """Worker side: whether the agent announced that round ``round_`` ended by a crash or a lost node
    (its collectives cannot complete: abort them); False when absent, malformed or for another round."""
    try:
        with open(path + ".recover") as f:
            body = json.load(f)
        return int(body["round"]) == round_ and body.get("broken") is True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def ready(path: str) -> bool:
    """Agent side: True once the newcomer worker whose assignment file is ``path`` is about to join."""
    return os.path.exists(path + ".ready")


def clear(path: str) -> None:
    """Agent side: remove a worker's assignment files before a fresh worker starts with ``path``."""
    for suffix in ("", ".optin", ".ready", ".recover"):
        try:
            os.remove(path + suffix)
        except OSError:
            pass


__all__ = ["ASSIGNED", "DURING_INPLACE", "EXIT_INPLACE_FAILED", "RECOVERABLE", "announce_recovery", "clear",
           "collectives_broken", "formed_round", "opted_in", "read_assignment", "ready", "recovery_announced",
           "write_assignment"]
