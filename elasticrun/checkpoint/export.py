"""Hugging Face layout for exported checkpoints: shard sizes, file names, the index, overwrite checks.

``transformers``' ``save_pretrained`` writes one ``model.safetensors``, or, above
``max_shard_size``, ``model-00001-of-0000N.safetensors`` files plus
``model.safetensors.index.json`` = ``{"metadata": {"total_size": N}, "weight_map": {tensor: file}}``.
Every file carries ``{"format": "pt"}`` metadata, which ``from_pretrained`` checks.
The split follows ``huggingface_hub.split_torch_state_dict_into_shards``: tensors in order,
a new shard when the next tensor would overflow the current one, a tensor bigger than the
limit alone in its own shard.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

from elasticrun.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # bytes: transformers' default, "5GB"
FORMAT_METADATA = {"format": "pt"}
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def split_shards(sizes: Sequence[Tuple[str, int]], max_size: int) -> List[List[str]]:
    """Tensor names grouped into shards of at most ``max_size`` bytes (see the module docstring)."""
    shards: List[List[str]] = []
    current: List[str] = []
    current_size = 0
    for name, size in sizes:
        if size > max_size:
            shards.append([name])
            continue
        if current and current_size + size > max_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not shards:
        shards.append(current)
    return shards


def shard_file_names(count: int) -> List[str]:
    """``["model.safetensors"]`` for one shard, else ``model-0000i-of-0000n.safetensors``."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def index_json(weight_map: Dict[str, str], total_size: int) -> str:
    """The text of ``model.safetensors.index.json`` (as transformers writes it)."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def existing_export_files(out_dir: str) -> List[str]:
    """Files in ``out_dir`` that a Hugging Face export writes (model*.safetensors, the index)."""
    try:
        names = os.listdir(out_dir)
    except OSError:
        return []
    return sorted(n for n in names if n in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(n))


def check_target(paths: Sequence[str], force: bool, checkpoint_dir: Optional[str]) -> None:
    """Refuse to write over an existing file without ``force``, and ever over the checkpoint's own files."""
    for path in paths:
        full = os.path.realpath(path)
        if checkpoint_dir is not None:
            own = os.path.realpath(checkpoint_dir)
            if full == own or full.startswith(own + os.sep):
                raise CheckpointError(f"--out {path} is inside the checkpoint being read ({checkpoint_dir}); "
                                      "write the export somewhere else")
        if os.path.isdir(full):
            raise CheckpointError(f"--out {path} is a directory; give a .safetensors file name")
        if os.path.exists(full) and not force:
            raise CheckpointError(f"--out {path} already exists; pass --force to overwrite it")


__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "FORMAT_METADATA",
    "INDEX_FILE",
    "SINGLE_FILE",
    "check_target",
    "existing_export_files",
    "index_json",
    "shard_file_names",
    "split_shards",
]
