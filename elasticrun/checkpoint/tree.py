"""State dict <-> (flat tensors, JSON skeleton), without pickle.

A state dict is a nested structure of dicts, lists and tuples whose leaves are tensors
or plain JSON values. ``flatten`` pulls the tensors out under dotted names
(``model.fc.weight``, ``optim.state.0.exp_avg``) and leaves a JSON skeleton where each
tensor is replaced by ``{"__tensor__": name}``; ``unflatten`` puts them back. Dicts whose
keys are not all strings (optimizer state uses ints) and tuples are encoded so that they
come back with the same key types.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Tuple

import torch

from elasticrun.errors import CheckpointError

TENSOR = "__tensor__"
ITEMS = "__items__"
TUPLE = "__tuple__"
_MARKERS = {TENSOR, ITEMS, TUPLE}
_SCALARS = (str, int, float, bool, type(None))


def flatten(state: Any) -> Tuple[Dict[str, torch.Tensor], Any]:
    """``(tensors by dotted name, JSON skeleton)``; raises CheckpointError on unsupported leaves."""
    tensors: Dict[str, torch.Tensor] = {}

    def walk(obj: Any, path: List[str]) -> Any:
        if isinstance(obj, torch.Tensor):
            name = ".".join(path)
            if not name:
                raise CheckpointError("the state dict must be a dict, not a single tensor")
            if name in tensors:
                raise CheckpointError(f"two tensors in the state dict flatten to the same name {name!r}: rename one")
            tensors[name] = obj
            return {TENSOR: name}
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj) and not (_MARKERS & set(obj)):
                return {k: walk(v, [*path, k]) for k, v in obj.items()}
            items = []
            for k, v in obj.items():
                if not isinstance(k, _SCALARS):
                    where = ".".join(path) or "<root>"
                    raise CheckpointError(f"state dict key {k!r} at {where} must be str/int/float/bool")
                items.append([k, walk(v, [*path, str(k)])])
            return {ITEMS: items}
        if isinstance(obj, tuple):
            return {TUPLE: [walk(v, [*path, str(i)]) for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [walk(v, [*path, str(i)]) for i, v in enumerate(obj)]
        if isinstance(obj, _SCALARS):
            if isinstance(obj, float) and not math.isfinite(obj):
                return obj  # json writes NaN/Infinity; we read them back
            return obj
        where = ".".join(path) or "<root>"
        raise CheckpointError(
            f"state dict value at {where!r} has type {type(obj).__name__}, which is neither a tensor nor a JSON "
            "value (checkpoints never pickle): convert it, e.g. to a tensor or with .tolist()"
        )

    if not isinstance(state, dict):
        raise CheckpointError(f"the state dict must be a dict, got {type(state).__name__}")
    skeleton = walk(state, [])
    return tensors, skeleton


def unflatten(skeleton: Any, get_tensor: Callable[[str], Any]) -> Any:
    """Rebuild the structure, calling ``get_tensor(name)`` for every tensor placeholder."""
    if isinstance(skeleton, dict):
        if TENSOR in skeleton and len(skeleton) == 1:
            return get_tensor(skeleton[TENSOR])
        if ITEMS in skeleton and len(skeleton) == 1:
            return {k: unflatten(v, get_tensor) for k, v in skeleton[ITEMS]}
        if TUPLE in skeleton and len(skeleton) == 1:
            return tuple(unflatten(v, get_tensor) for v in skeleton[TUPLE])
        return {k: unflatten(v, get_tensor) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, get_tensor) for v in skeleton]
    return skeleton


def check_fits(target: Any, loaded: Any, path: str = "") -> None:
    """Raise the CheckpointError :func:`fill_in_place` would raise, without writing anything,
    so a load into existing tensors either fills every tensor or none."""
    fill_in_place(target, loaded, path, dry_run=True)


def fill_in_place(target: Any, loaded: Any, path: str = "", dry_run: bool = False) -> Any:
    """Copy ``loaded`` into ``target`` (DCP-style: a load into existing tensors); returns the merged structure.

    Tensors in ``target`` are filled with ``copy_`` (so parameters keep their identity);
    other values are replaced. Keys missing from the checkpoint raise CheckpointError.
    ``dry_run`` raises the same errors without writing or replacing anything.
    """
    if isinstance(target, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise CheckpointError(f"{path!r} is a tensor in the state dict but not in the checkpoint")
        if tuple(target.shape) != tuple(loaded.shape):
            raise CheckpointError(
                f"tensor {path!r}: the checkpoint gives this rank shape {tuple(loaded.shape)} but the state dict "
                f"has {tuple(target.shape)}: check the model config and the placements"
            )
        if loaded is not target and not dry_run:
            with torch.no_grad():
                target.copy_(loaded)
        return target
    if isinstance(target, dict):
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{path or '<root>'!r} is a dict in the state dict but not in the checkpoint")
        for k in target:
            if k not in loaded:
                raise CheckpointError(f"key {(path + '.' if path else '') + str(k)!r} is missing from the checkpoint")
            merged = fill_in_place(target[k], loaded[k], f"{path}.{k}" if path else str(k), dry_run)
            if not dry_run:
                target[k] = merged
        return target
    if isinstance(target, list) and isinstance(loaded, list) and len(target) == len(loaded):
        for i in range(len(target)):
            merged = fill_in_place(target[i], loaded[i], f"{path}.{i}", dry_run)
            if not dry_run:
                target[i] = merged
        return target
    return loaded
