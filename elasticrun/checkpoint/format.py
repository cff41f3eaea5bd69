"""The on-disk format: names, placements, dtypes and the ``metadata.json`` schema.

A checkpoint is a directory ``<root>/<name>/`` holding safetensors shard files and a
``metadata.json`` written last (the commit marker). This module only describes that
format (dataclasses <-> JSON, with clear errors on anything malformed); it does no I/O
and does not import torch, so listing and verifying stay fast.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from elasticrun.errors import CheckpointError

FORMAT_NAME = "elasticrun-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
TMP_MARKER = ".tmp-"
LATEST = "latest"
# Checkpoint names become directory names: keep them boring and unable to escape the root.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")

# safetensors dtype codes <-> torch dtype attribute names, and their sizes in bytes.
DTYPES: Dict[str, Tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "U16": ("uint16", 2),
    "U32": ("uint32", 4),
    "U64": ("uint64", 8),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "C64": ("complex64", 8),
}


def shard_file_name(rank: int, world_size: int, part: int = 0, parts: int = 1) -> str:
    """``shard-00001-of-00004.safetensors``: the file written by ``rank`` — or, when a rank
    writes several files in parallel, ``shard-00001-of-00004-part-2-of-3.safetensors``."""
    base = f"shard-{rank:05d}-of-{world_size:05d}"
    return f"{base}.safetensors" if parts == 1 else f"{base}-part-{part}-of-{parts}.safetensors"


def is_safe_file_name(fname: str) -> bool:
    """Whether a file name from ``metadata.json`` stays inside the checkpoint directory."""
    return bool(_NAME_RE.match(fname)) and ".." not in fname and fname != METADATA_FILE


def validate_name(name: str) -> str:
    """Return ``name`` if it is a safe checkpoint name, else raise CheckpointError."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name == LATEST or ".." in name:
        raise CheckpointError(
            f"invalid checkpoint name {name!r}: use 1-200 letters, digits, '.', '_' or '-', starting with a "
            f"letter or digit (no path separators, no '..', not {LATEST!r})"
        )
    return name


def tmp_dir_name(name: str, token: str) -> str:
    """Name of the temporary directory a save of ``name`` writes into before its commit."""
    return f".{name}{TMP_MARKER}{token}"


def parse_tmp_dir_name(dirname: str) -> Optional[str]:
    """The checkpoint name a temporary directory belongs to, or None if it is not one."""
    if not dirname.startswith(".") or TMP_MARKER not in dirname:
        return None
    return dirname[1:].rsplit(TMP_MARKER, 1)[0] or None


# -- placements ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """A tensor of which every rank holds a slice along ``dim`` (slices may be uneven)."""

    dim: int = 0

    def to_json(self) -> Dict[str, Any]:
        return {"type": "shard", "dim": self.dim}


@dataclass(frozen=True)
class Replicate:
    """A tensor that is the same on every rank (plain DDP): written once, split across ranks."""

    def to_json(self) -> Dict[str, Any]:
        return {"type": "replicate"}


Placement = Union[Shard, Replicate]


def placement_from_json(d: Dict[str, Any]) -> Placement:
    if d.get("type") == "shard":
        return Shard(int(d["dim"]))
    if d.get("type") == "replicate":
        return Replicate()
    raise ValueError(f"unknown placement {d!r}")


# -- metadata ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """A box of a global tensor stored as tensor ``key`` in ``file``."""

    file: str
    key: str
    offsets: Tuple[int, ...]
    shape: Tuple[int, ...]

    def to_json(self) -> Dict[str, Any]:
        return {"file": self.file, "key": self.key, "offsets": list(self.offsets), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> Chunk:
        offsets = tuple(int(x) for x in d["offsets"])
        return cls(str(d["file"]), str(d["key"]), offsets, tuple(int(x) for x in d["shape"]))


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the state dict: global shape, dtype, how it was placed, where its chunks are."""

    name: str
    dtype: str  # safetensors code, e.g. "F32"
    shape: Tuple[int, ...]
    placement: Placement
    chunks: Tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype][1]
        for s in self.shape:
            n *= s
        return n

    def to_json(self) -> Dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "placement": self.placement.to_json(),
            "chunks": [c.to_json() for c in self.chunks],
        }

    @classmethod
    def from_json(cls, name: str, d: Dict[str, Any]) -> TensorEntry:
        dtype = str(d["dtype"])
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r} has unknown dtype {dtype!r}")
        return cls(
            name=name,
            dtype=dtype,
            shape=tuple(int(x) for x in d["shape"]),
            placement=placement_from_json(d["placement"]),
            chunks=tuple(Chunk.from_json(c) for c in d["chunks"]),
        )


@dataclass(frozen=True)
class FileEntry:
    """A shard file: who wrote it, its size and sha256."""

    name: str
    rank: int
    size: int
    sha256: str

    def to_json(self) -> Dict[str, Any]:
        return {"rank": self.rank, "size": self.size, "sha256": self.sha256}


@dataclass
class CheckpointMeta:
    """Everything in ``metadata.json``."""

    name: str
    world_size: int
    created: float
    tensors: Dict[str, TensorEntry]
    files: Dict[str, FileEntry]
    tree: Any  # the state dict's structure; tensors appear as {"__tensor__": name}
    training_state: Optional[Dict[str, Any]] = None
    user_metadata: Dict[str, Any] = field(default_factory=dict)
    version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def step(self) -> Optional[int]:
        return None if self.training_state is None else self.training_state.get("step")

    @property
    def epoch(self) -> Optional[int]:
        return None if self.training_state is None else self.training_state.get("epoch")

    def to_json(self) -> Dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "name": self.name,
            "world_size": self.world_size,
            "created": self.created,
            "training_state": self.training_state,
            "user_metadata": self.user_metadata,
            "files": {n: f.to_json() for n, f in sorted(self.files.items())},
            "tensors": {n: t.to_json() for n, t in self.tensors.items()},
            "tree": self.tree,
        }

    def dumps(self) -> bytes:
        try:
            return json.dumps(self.to_json(), indent=1, allow_nan=True).encode()
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint metadata is not JSON-serialisable: {err}") from None

    @classmethod
    def loads(cls, data: bytes, where: str) -> CheckpointMeta:
        """Parse ``metadata.json`` bytes; any problem is a CheckpointError naming ``where``."""
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{where} is not valid JSON ({err}): the checkpoint is corrupt") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{where} is not an elasticrun checkpoint metadata file")
        version = d.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise CheckpointError(
                f"{where} has format version {version!r}; this elasticrun reads up to {FORMAT_VERSION}: upgrade it"
            )
        try:
            files = {
                str(n): FileEntry(str(n), int(f["rank"]), int(f["size"]), str(f["sha256"]))
                for n, f in d["files"].items()
            }
            tensors = {str(n): TensorEntry.from_json(str(n), t) for n, t in d["tensors"].items()}
            meta = cls(
                name=str(d["name"]),
                world_size=int(d["world_size"]),
                created=float(d["created"]),
                tensors=tensors,
                files=files,
                tree=d.get("tree"),
                training_state=d.get("training_state"),
                user_metadata=d.get("user_metadata") or {},
                version=version,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            problem = f"{err.__class__.__name__}: {err}"
            raise CheckpointError(f"{where} is malformed ({problem}): the checkpoint is corrupt") from None
        for fname in files:
            if not is_safe_file_name(fname):
                raise CheckpointError(f"{where} names the file {fname!r}, which is not a plain file name: the "
                                      "checkpoint is corrupt or was tampered with")
        for t in tensors.values():
            for c in t.chunks:
                if c.file not in files:
                    raise CheckpointError(f"{where}: tensor {t.name!r} points to unknown file {c.file!r}")
        return meta


def chunks_by_file(meta: CheckpointMeta) -> Dict[str, List[Tuple[TensorEntry, Chunk]]]:
    """Every chunk of the checkpoint, grouped by the file that holds it."""
    out: Dict[str, List[Tuple[TensorEntry, Chunk]]] = {f: [] for f in meta.files}
    for t in meta.tensors.values():
        for c in t.chunks:
            out[c.file].append((t, c))
    return out
