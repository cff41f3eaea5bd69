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

from elasticrun.checkpoint.checksum import Checksum
from elasticrun.errors import CheckpointError

FORMAT_NAME = "elasticrun-checkpoint"
#: 2: a file's checksum is stored under its algorithm's name (``crc32`` or ``sha256``);
#: 1: always ``sha256``. Both are read.
FORMAT_VERSION = 2
METADATA_FILE = "metadata.json"
TMP_MARKER = ".tmp-"
#: Created by the writer in a save's temporary directory when it starts (removed after the
#: commit): marks a directory as this format's in-progress/crashed save, and says who writes it.
INCOMPLETE_MARKER = ".elasticrun-incomplete"
#: metadata.json larger than this is refused (read with a bounded read, never whole).
MAX_METADATA_BYTES = 256 << 20
#: Deepest nesting of the state dict's structure ("tree") that metadata.json may hold.
MAX_TREE_DEPTH = 200
LATEST = "latest"
# Checkpoint names become directory names: keep them boring and unable to escape the root.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")

# Every safetensors dtype code of whole bytes per element: the name of its torch dtype and its size
# in bytes. Which of them a process can save or load depends on its torch (the float8 kinds came in
# torch 2.1 to 2.7): checkpoint.shardfile keeps those torch has, as safetensors.torch does.
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
    "F8_E4M3FNUZ": ("float8_e4m3fnuz", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E5M2FNUZ": ("float8_e5m2fnuz", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),
    "C64": ("complex64", 8),
}


def shard_file_name(rank: int, world_size: int, part: int = 0, parts: int = 1) -> str:
    """``shard-00001-of-00004.safetensors``: the file written by ``rank`` — or, when a rank
    writes several files in parallel, ``shard-00001-of-00004-part-2-of-3.safetensors``."""
    base = f"shard-{rank:05d}-of-{world_size:05d}"
    return f"{base}.safetensors" if parts == 1 else f"{base}-part-{part}-of-{parts}.safetensors"


_SHARD_RE = re.compile(r"^shard-\d{5}-of-\d{5}(-part-\d+-of-\d+)?\.safetensors$")


def is_shard_file_name(fname: str) -> bool:
    """Whether ``fname`` is a name :func:`shard_file_name` makes."""
    return bool(_SHARD_RE.match(fname))


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
    if not isinstance(d, dict):
        raise ValueError(f"placement must be an object, got {type(d).__name__}")
    if d.get("type") == "shard":
        return Shard(_nonneg(d["dim"], "placement dim"))
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
        if not isinstance(d, dict):
            raise ValueError(f"chunk must be an object, got {type(d).__name__}")
        return cls(_str(d["file"], "chunk file"), _str(d["key"], "chunk key"), _dims(d["offsets"], "chunk offsets"),
                   _dims(d["shape"], "chunk shape"))


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
        if not isinstance(d, dict):
            raise ValueError(f"tensor {name!r} must be an object, got {type(d).__name__}")
        dtype = d["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ValueError(f"tensor {name!r} has unknown dtype {dtype!r}")
        shape = _dims(d["shape"], f"shape of {name!r}")
        chunks = d["chunks"]
        if not isinstance(chunks, list):
            raise ValueError(f"chunks of {name!r} must be a list")
        entry = cls(name=name, dtype=dtype, shape=shape, placement=placement_from_json(d["placement"]),
                    chunks=tuple(Chunk.from_json(c) for c in chunks))
        for c in entry.chunks:
            if len(c.offsets) != len(shape) or len(c.shape) != len(shape) or any(
                    o + n > s for o, n, s in zip(c.offsets, c.shape, shape)):
                raise ValueError(f"a chunk of {name!r} (offsets {list(c.offsets)}, shape {list(c.shape)}) lies "
                                 f"outside the tensor's shape {list(shape)}")
        return entry


@dataclass(frozen=True)
class FileEntry:
    """A shard file: who wrote it, its size and its checksum (``digest`` by ``algo``)."""

    name: str
    rank: int
    size: int
    digest: str
    algo: Checksum

    def to_json(self) -> Dict[str, Any]:
        return {"rank": self.rank, "size": self.size, self.algo.value: self.digest}

    @classmethod
    def from_json(cls, name: str, f: Dict[str, Any]) -> FileEntry:
        algos = [a for a in Checksum if a.value in f]
        if len(algos) != 1:
            raise ValueError(f"file {name!r} must carry exactly one checksum "
                             f"({' or '.join(a.value for a in Checksum)})")
        algo = algos[0]
        digest = _str(f[algo.value], algo.value)
        if not algo.is_digest(digest):
            raise ValueError(f"file {name!r} has an invalid {algo.value} {digest[:80]!r}")
        return cls(name, _nonneg(f["rank"], "rank"), _nonneg(f["size"], "size"), digest, algo)


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
    #: Commit sequence number: 1 + the highest one in the root when it was committed (None in
    #: checkpoints written before it existed). Orders checkpoints of the same step.
    seq: Optional[int] = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    @property
    def step(self) -> Optional[int]:
        return _opt_int(None if self.training_state is None else self.training_state.get("step"))

    @property
    def epoch(self) -> Optional[int]:
        return _opt_int(None if self.training_state is None else self.training_state.get("epoch"))

    def order_key(self) -> Tuple[int, int, float]:
        """How checkpoints are ordered ("latest" is the greatest): training step, then commit
        sequence — never a clock, except as the last tie-break between legacy checkpoints that
        have no sequence number. Checkpoints without a step sort before those with one."""
        step = -1 if self.step is None else self.step
        if self.seq is not None:
            return step, self.seq, 0.0
        created = self.created if isinstance(self.created, float) and self.created == self.created else 0.0
        return step, -1, created

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
            **({} if self.seq is None else {"seq": self.seq}),
        }

    def dumps(self) -> bytes:
        try:
            return json.dumps(self.to_json(), indent=1, allow_nan=True).encode()
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"checkpoint metadata is not JSON-serialisable: {err}") from None

    @classmethod
    def loads(cls, data: bytes, where: str) -> CheckpointMeta:
        """Parse ``metadata.json`` bytes; any problem is a CheckpointError naming ``where``.

        Everything is checked (types, ranges, chunks inside their tensors, file names that stay
        inside the checkpoint), so later stages never meet a malformed value."""
        if len(data) > MAX_METADATA_BYTES:
            raise CheckpointError(f"{where} is larger than {MAX_METADATA_BYTES >> 20} MiB: refusing to parse it")
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as err:
            reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
            raise CheckpointError(f"{where} is not valid JSON ({reason}): the checkpoint is corrupt") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{where} is not an elasticrun checkpoint metadata file")
        version = d.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
            raise CheckpointError(
                f"{where} has format version {version!r}; this elasticrun reads up to {FORMAT_VERSION}: upgrade it"
            )
        try:
            meta = cls._from_dict(d, version)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, RecursionError) as err:
            problem = f"{err.__class__.__name__}: {err}"[:300]
            raise CheckpointError(f"{where} is malformed ({problem}): the checkpoint is corrupt") from None
        for fname in meta.files:
            if not is_safe_file_name(fname):
                raise CheckpointError(f"{where} names the file {fname!r}, which is not a plain file name: the "
                                      "checkpoint is corrupt or was tampered with")
        for t in meta.tensors.values():
            for c in t.chunks:
                if c.file not in meta.files:
                    raise CheckpointError(f"{where}: tensor {t.name!r} points to unknown file {c.file!r}")
        return meta

    @classmethod
    def _from_dict(cls, d: Dict[str, Any], version: int) -> CheckpointMeta:
        files_raw, tensors_raw = _obj(d["files"], "files"), _obj(d["tensors"], "tensors")
        files = {}
        for n, f in files_raw.items():
            files[n] = FileEntry.from_json(n, _obj(f, f"file {n!r}"))
            if version < 2 and files[n].algo is not Checksum.SHA256:
                raise ValueError(f"file {n!r} of a version {version} checkpoint must carry a sha256")
        tensors = {n: TensorEntry.from_json(n, t) for n, t in tensors_raw.items()}
        world_size = _nonneg(d["world_size"], "world_size")
        if world_size < 1:
            raise ValueError("world_size must be at least 1")
        created = d["created"]
        if isinstance(created, bool) or not isinstance(created, (int, float)):
            raise ValueError(f"created must be a number, got {type(created).__name__}")
        ts = d.get("training_state")
        if ts is not None:
            ts = _obj(ts, "training_state")
            for key in ("step", "epoch"):
                if ts.get(key) is not None and _opt_int(ts[key]) is None:
                    raise ValueError(f"training_state.{key} must be an integer, got {ts[key]!r}"[:200])
        seq = d.get("seq")
        tree = d.get("tree")
        _check_depth(tree)
        return cls(
            name=_str(d["name"], "name"),
            world_size=world_size,
            created=float(created),
            tensors=tensors,
            files=files,
            tree=tree,
            training_state=ts,
            user_metadata=_obj(d.get("user_metadata") or {}, "user_metadata"),
            version=version,
            seq=None if seq is None else _nonneg(seq, "seq"),
        )


def _opt_int(x: Any) -> Optional[int]:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _nonneg(x: Any, what: str) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {x!r}"[:200])
    return x


def _str(x: Any, what: str) -> str:
    if not isinstance(x, str):
        raise ValueError(f"{what} must be a string, got {type(x).__name__}")
    return x


def _obj(x: Any, what: str) -> Dict[str, Any]:
    if not isinstance(x, dict):
        raise ValueError(f"{what} must be an object, got {type(x).__name__}")
    return x


def _dims(x: Any, what: str) -> Tuple[int, ...]:
    if not isinstance(x, list) or len(x) > 64:
        raise ValueError(f"{what} must be a list of at most 64 integers")
    return tuple(_nonneg(v, what) for v in x)


def _check_depth(tree: Any) -> None:
    """Refuse a structure nested deeper than MAX_TREE_DEPTH (iteratively: no recursion)."""
    stack = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_TREE_DEPTH:
            raise ValueError(f"the state dict structure is nested deeper than {MAX_TREE_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def chunks_by_file(meta: CheckpointMeta) -> Dict[str, List[Tuple[TensorEntry, Chunk]]]:
    """Every chunk of the checkpoint, grouped by the file that holds it."""
    out: Dict[str, List[Tuple[TensorEntry, Chunk]]] = {f: [] for f in meta.files}
    for t in meta.tensors.values():
        for c in t.chunks:
            out[c.file].append((t, c))
    return out
