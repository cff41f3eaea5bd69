"""Random number generator state in checkpoints: saved per rank, restored or re-derived.

A resumed job only repeats the uninterrupted run's random numbers (dropout masks, noise,
augmentation) if every generator continues where it stopped. :func:`capture_rng` takes,
collectively, every rank's state of the four generators a training script normally
touches — torch's CPU generator, the current CUDA device's generator (when CUDA is
initialised), Python's :mod:`random` and numpy's global ``np.random`` — and returns one
plain-JSON value to put in the checkpoint's state dict (non-tensor leaves go into
``metadata.json``; about 20 KB per rank). :func:`restore_rng` puts them back:

- at the **same world size**, rank ``r`` gets exactly the state rank ``r`` saved, so a
  crash-and-restart continues the same random streams (a replayed step draws the same
  numbers it drew before the crash);
- at a **different world size** the old per-rank streams have no meaning for the new
  ranks, so every generator is *re-derived* from ``(seed, step, rank)``
  (:func:`derive_seed`): deterministic — two resumes of the same checkpoint at the same
  new world size draw the same numbers — but not the uninterrupted run's.

Randomness that must not depend on the world size at all (e.g. per-sample augmentation
when the run must equal an uninterrupted one) should be keyed by the sample instead:
``torch.Generator().manual_seed(derive_seed(seed, epoch, index))``.

:func:`elasticrun.train.load_latest` calls :func:`restore_rng` by itself when the
checkpoint holds an ``"rng"`` entry.
"""

from __future__ import annotations

import base64
import hashlib
import random
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from elasticrun.errors import CheckpointError

RNG_KEY = "rng"  # the state-dict entry load_latest looks for
FORMAT_VERSION = 1


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (e.g. ``seed, step, rank``), stable across processes and
    Python versions (sha256, not ``hash()``)."""
    text = ",".join(str(int(p)) for p in parts).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def seed_all(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), Python's ``random`` and numpy's global RNG."""
    torch.manual_seed(seed)  # also seeds every CUDA device (lazily if CUDA is not initialised)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return
    np.random.seed(seed % (2**32))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def local_rng_state() -> Dict[str, Any]:
    """This process's generator states as plain JSON."""
    state: Dict[str, Any] = {"torch": _b64(torch.get_rng_state().numpy().tobytes())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = _b64(torch.cuda.get_rng_state().numpy().tobytes())
    version, internal, gauss = random.getstate()
    state["python"] = {"version": version, "state": list(internal), "gauss": gauss}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": _b64(np.asarray(keys, dtype="<u4").tobytes()), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def set_local_rng_state(state: Dict[str, Any]) -> None:
    """Put back what :func:`local_rng_state` returned (a missing generator is left alone)."""
    try:
        torch.set_rng_state(torch.frombuffer(bytearray(_unb64(state["torch"])), dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(_unb64(state["cuda"])), dtype=torch.uint8))
        py = state.get("python")
        if py is not None:
            random.setstate((int(py["version"]), tuple(int(v) for v in py["state"]), py["gauss"]))
        npst = state.get("numpy")
        if npst is not None:
            import numpy as np

            keys = np.frombuffer(_unb64(npst["keys"]), dtype="<u4").astype(np.uint32)
            np.random.set_state((npst["kind"], keys, int(npst["pos"]), int(npst["has_gauss"]),
                                 float(npst["cached_gaussian"])))
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"the checkpoint's RNG state is malformed ({err}); it cannot be restored") from None


def _group_info(group: Any) -> tuple[bool, int, int]:
    is_dist = dist.is_available() and dist.is_initialized()
    if not is_dist:
        return False, 0, 1
    return True, dist.get_rank(group), dist.get_world_size(group)


def capture_rng(seed: int, group: Any = None) -> Dict[str, Any]:
    """Collective: every rank's generator states, gathered; put the result in the state dict
    under ``"rng"`` (:data:`RNG_KEY`). ``seed`` is the job's base seed, used to re-derive
    the generators if the checkpoint is resumed at another world size."""
    is_dist, _, world = _group_info(group)
    mine = local_rng_state()
    states: List[Any] = [mine]
    if is_dist and world > 1:
        states = [None] * world
        dist.all_gather_object(states, mine, group=group)
    return {"version": FORMAT_VERSION, "seed": int(seed), "world_size": world, "ranks": states}


class RngRestore(str):
    """What :func:`restore_rng` did: ``"restored"`` (same world size) or ``"re-derived"``."""


RESTORED = RngRestore("restored")
REDERIVED = RngRestore("re-derived")


def restore_rng(
    saved: Dict[str, Any],
    *,
    step: int,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    group: Any = None,
) -> RngRestore:
    """Restore this rank's generators from :func:`capture_rng`'s value (no collective).

    At the saving world size rank ``r`` gets rank ``r``'s states back; otherwise every
    generator is seeded with ``derive_seed(seed, step, rank)``. Returns which one happened.
    """
    _, grank, gworld = _group_info(group)
    rank = grank if rank is None else rank
    world_size = gworld if world_size is None else world_size
    try:
        ranks = saved["ranks"]
        saved_world = int(saved["world_size"])
        seed = int(saved["seed"])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"the checkpoint's RNG state is malformed (missing {err})") from None
    if saved_world == world_size and len(ranks) == world_size:
        set_local_rng_state(ranks[rank])
        return RESTORED
    seed_all(derive_seed(seed, step, rank))
    return REDERIVED


__all__ = [
    "REDERIVED",
    "RESTORED",
    "RNG_KEY",
    "RngRestore",
    "capture_rng",
    "derive_seed",
    "local_rng_state",
    "restore_rng",
    "seed_all",
    "set_local_rng_state",
]
