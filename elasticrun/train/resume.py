"""Resume from the newest loadable checkpoint, telling "nothing saved yet" from "broken".

``elasticrun.checkpoint.load(root, "latest")`` raises the same :class:`CheckpointError`
for an empty directory and for a corrupt checkpoint. A training script needs to tell
them apart: the first means "start from scratch", the second must not silently throw
away progress. :func:`load_latest` returns ``None`` only when there is no complete
checkpoint at all; otherwise it loads the newest one, and with ``fallback=True`` (the
default) steps back to older complete checkpoints, logging a warning for each one it
skips, so a job does not crash-loop on one damaged checkpoint.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

from elasticrun.errors import CheckpointError
from elasticrun.train.progress import note_restored

if TYPE_CHECKING:
    from elasticrun.checkpoint import LoadedCheckpoint

log = logging.getLogger(__name__)


def complete_checkpoints(root: str, process_group: Any = None) -> List[str]:
    """Names of the complete checkpoints under ``root``, newest first, as rank 0 sees them
    (collective when a process group exists, so every rank gets the same list)."""
    from elasticrun.checkpoint import CheckpointStatus, list_checkpoints
    from elasticrun.checkpoint.comm import on_rank0

    return on_rank0(
        lambda: [i.name for i in reversed(list_checkpoints(root)) if i.status == CheckpointStatus.COMPLETE],
        process_group,
    )


def load_latest(
    root: str,
    *,
    state_dict: Optional[Dict[str, Any]] = None,
    placements: Optional[Mapping[str, Any]] = None,
    process_group: Any = None,
    fallback: bool = True,
    sampler: Any = None,
    restore_rng: bool = True,
    memory: bool = True,
) -> Optional[LoadedCheckpoint]:
    """Load the newest complete checkpoint under ``root`` (collective), or ``None`` if there is none.

    ``state_dict``, ``placements`` and ``process_group`` are those of
    :func:`elasticrun.checkpoint.load`. In the same call, when the checkpoint has them:
    ``sampler.load_state_dict(state["sampler"])`` (pass the sampler) and, with
    ``restore_rng`` (default), the generators saved under ``"rng"`` by
    :func:`elasticrun.train.rng.capture_rng` — restored per rank at the same world size,
    re-derived from (seed, step, rank) at another (see :mod:`elasticrun.train.rng`).
    With ``memory`` (default) the job's memory snapshots (:mod:`elasticrun.checkpoint.memory`:
    every node's parts and peer replicas together, at any world size; missing parts are fetched
    from peers' memory) compete with ``root`` by training step, memory first at equal steps;
    the result's ``.tier`` says which one was loaded. A memory restore that fails in any way
    falls back to the next candidate on every rank alike, and that generation is not tried again.
    Raises :class:`CheckpointError` when checkpoints exist but none can be loaded (or the
    newest cannot, with ``fallback=False``); the state dict then holds whatever was read last
    (a memory restore checks its bytes as it copies them), not a state to train from.
    """
    from elasticrun.checkpoint import load
    from elasticrun.checkpoint.memory import ResumedCheckpoint, Tier, candidates, drop_newer_generations

    # Both tiers, newest step first: memory snapshots (ELASTICRUN_SNAPSHOT_DIR) and ``root``.
    names = candidates(root, process_group, memory=memory)
    if not names:
        return None
    failures = []
    for tier, where, name in names if fallback else names[:1]:
        error: Optional[str] = None
        try:
            if tier is Tier.MEMORY:
                ckpt, error = _try_memory(name, state_dict, placements, process_group)
            else:
                ckpt = load(where, name, state_dict=state_dict, placements=placements, process_group=process_group)
        except CheckpointError as err:  # raised on every rank alike, so all ranks move on together
            error = str(err)
        if error is not None:
            failures.append(f"{name}: {error}")
            if fallback and len(failures) < len(names):
                log.warning("checkpoint %s cannot be loaded (%s); trying the previous one", name, error)
            continue
        _restore_extras(ckpt, sampler, restore_rng, process_group)
        step = ckpt.training_state.step if ckpt.training_state is not None else None
        drop_newer_generations(step)
        note_restored(step)  # the progress reports tell the agent where this round resumed
        return ResumedCheckpoint.of(ckpt, tier, where)
    raise CheckpointError(
        f"no checkpoint under {root} could be loaded ({len(failures)} tried); newest: {failures[0]}"
    )


def _try_memory(name: str, state_dict: Optional[Dict[str, Any]], placements: Optional[Mapping[str, Any]],
                process_group: Any) -> Tuple[Optional[LoadedCheckpoint], Optional[str]]:
    """Restore memory generation ``name``: ``(checkpoint, None)``, or ``(None, why)`` on every rank
    alike when it failed on any rank in any way (a full ``/dev/shm``, a gloo error or time-out
    during a peer fetch): the ranks agree in one collective, so none loads another step, and
    the generation is marked failed, so no later restore tries it again. When the ranks cannot
    even agree (the process group is broken) it is marked failed here and CheckpointError is
    raised: the restarted round skips it."""
    from elasticrun.checkpoint.comm import Comm
    from elasticrun.checkpoint.memory import mark_failed
    from elasticrun.checkpoint.storage import describe

    ckpt: Optional[LoadedCheckpoint] = None
    error: Optional[str] = None
    try:
        ckpt = _load_memory(name, state_dict, placements, process_group)
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # noqa: BLE001 - any failure of the memory path falls back to the next candidate
        error = f"memory snapshot {name!r} could not be restored: {describe(err)}"
    try:
        errors = Comm(process_group).all_gather(error)
    except Exception as err:  # noqa: BLE001 - the group is broken: this round cannot go on
        mark_failed(name)
        raise CheckpointError(f"memory snapshot {name!r} could not be restored ({error or describe(err)}) and the "
                              "ranks cannot agree on a fallback; the restarted round skips it") from None
    first = next((e for e in errors if e), None)
    if first is not None:
        mark_failed(name)
        return None, first
    return ckpt, None


def _load_memory(name: str, state_dict: Optional[Dict[str, Any]], placements: Optional[Mapping[str, Any]],
                 process_group: Any) -> LoadedCheckpoint:
    """Load memory generation ``name``: the files each node's ranks will read are first gathered
    there from peers' memory where missing, and every byte is checked as it is copied
    (:func:`~elasticrun.checkpoint.memory.load.load_generation`). Tensors are private copies,
    not maps of the files: once loaded, nothing keeps a generation's shared memory alive after
    retention removes it."""
    from elasticrun.checkpoint.memory import load_generation

    t0 = time.perf_counter()
    ckpt, fetched = load_generation(name, state_dict, placements, process_group)
    log.info("restored memory snapshot %s in %.2fs (%d file(s), %d bytes fetched from peers)", name,
             time.perf_counter() - t0, fetched["files"], fetched["bytes"])
    return ckpt


def _restore_extras(ckpt: LoadedCheckpoint, sampler: Any, restore_rng: bool, process_group: Any) -> None:
    from elasticrun.train.rng import RNG_KEY
    from elasticrun.train.rng import restore_rng as do_restore

    state = ckpt.state_dict
    if sampler is not None and isinstance(state.get("sampler"), dict):
        sampler.load_state_dict(state["sampler"])
    if restore_rng and isinstance(state.get(RNG_KEY), dict):
        step = ckpt.training_state.step if ckpt.training_state is not None else 0
        how = do_restore(state[RNG_KEY], step=step, group=process_group)
        log.debug("RNG state %s from %s", how, ckpt.name)


__all__ = ["complete_checkpoints", "load_latest"]
