"""Bring the files of a memory generation that each node will read onto it, from its peers' memory.

:func:`materialize` (collective) runs before a memory generation is loaded. Each rank works
out which files it will read (:func:`files_needed`: the chunks that overlap its part of each
tensor at the new world size); a node whose own ``generations/<name>/`` holds every file its
ranks read loads from there (e.g. a worker restarted on the same node: nothing moves). Any
other node — one that lost a peer (its parts are in a survivor's ``replicas/``), or a
newcomer after a scale-up (it has nothing) — gets ``<snapshot dir>/restore/<name>/``: hard
links to the files it needs and holds, plus the missing ones it needs fetched from the
first node that holds each one, over the process group
(point-to-point, in one global order that every rank computes alike: deadlock-free). The
normal resharding reader then loads from there at any world size. What a node fetches counts
against the memory tier's cap (:mod:`~.space`) and must fit in its free shared memory: a
restore that would not fit fails (on every rank alike) before any byte moves, and
``load_latest`` falls back to the next checkpoint.

Integrity: every file of a memory generation was hashed when it was written (the checksum in
``metadata.json`` is computed over the bytes written), and a replica or a fetched file is checked
against ``metadata.json`` on receipt. Shared memory can still change afterwards, so the load
itself checks every byte it copies (:mod:`~.load`, :mod:`~.integrity`); the local copies it found
changed are passed back in as ``corrupt``, and :func:`materialize` then fetches those files from
another node that holds them (its ring successor's replica) — or, when none does, fails on every
rank alike, and ``load_latest`` falls back to the next checkpoint (an older generation, then
disk). Disk checkpoints are hashed on load.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from elasticrun.checkpoint.comm import Comm
from elasticrun.checkpoint.format import METADATA_FILE, CheckpointMeta
from elasticrun.checkpoint.memory.commit import NodeLayout
from elasticrun.checkpoint.memory.replicas import recv_file, send_file
from elasticrun.checkpoint.memory.restore import gather_inventories
from elasticrun.checkpoint.memory.space import dir_bytes, memory_cap
from elasticrun.checkpoint.regions import region_for
from elasticrun.checkpoint.storage import describe
from elasticrun.errors import CheckpointError
from elasticrun.job.shm import GENERATIONS, REPLICAS, ShmLayout, snapshot_dir
from elasticrun.sizes import format_size

log = logging.getLogger(__name__)


def _local_path(base: str, name: str, fname: str) -> Optional[str]:
    for sub in (GENERATIONS, REPLICAS):
        p = os.path.join(base, sub, name, fname)
        if os.path.exists(p):
            return p
    return None


def files_needed(meta: CheckpointMeta, names: Optional[Sequence[str]], placements: Mapping[str, Any], rank: int,
                 world: int) -> Set[str]:
    """The files of ``meta`` that ``rank`` of ``world`` reads to load ``names`` (None: every
    tensor) under ``placements``: those holding a chunk that overlaps the rank's region."""
    out: Set[str] = set()
    for n in meta.tensors if names is None else names:
        entry = meta.tensors.get(n)
        if entry is None:
            continue  # the load reports it
        offsets, shape = region_for(entry, placements.get(n, entry.placement), rank, world)
        for c in entry.chunks:
            if all(max(o, co) < min(o + s, co + cs) for o, s, co, cs in zip(offsets, shape, c.offsets, c.shape)):
                out.add(c.file)
    return out


def _room_problem(base: str, name: str, node: int, nbytes: int) -> Optional[str]:
    """Why this node cannot take ``nbytes`` more for restoring ``name`` (the cap, or free space)."""
    try:
        cap, label = memory_cap(base)
        used, st = dir_bytes(base), os.statvfs(base)
    except (OSError, ValueError) as err:
        return f"memory snapshot {name!r}: cannot size its restore on node {node}: {err}"
    if used + nbytes > cap:
        return (f"memory snapshot {name!r}: restoring it on node {node} takes {format_size(nbytes)} more (files "
                f"fetched from peers, its metadata), {format_size(used + nbytes)} in all, over {label} "
                f"({format_size(cap)})")
    if nbytes > st.f_bavail * st.f_frsize:
        free = st.f_bavail * st.f_frsize
        return f"memory snapshot {name!r}: node {node} has {format_size(free)} of shared memory free"
    return None


def _leave_out(have: List[Dict[str, Any]], layout: NodeLayout,
               corrupt: Optional[Sequence[Sequence[str]]]) -> List[Dict[str, Any]]:
    """``have`` without the local copies that failed their checksum: ``corrupt[r]`` names the files
    rank ``r`` found changed on its node; another node's copy is fetched instead (or none is left)."""
    out = []
    for n, node_ranks in enumerate(layout.nodes):
        drop = {f for r in node_ranks for f in (corrupt[r] if corrupt else ())}
        out.append(dict(have[n], gen=[f for f in have[n]["gen"] if f not in drop],
                        rep=[f for f in have[n]["rep"] if f not in drop], corrupt=sorted(drop)))
    return out


def materialize(name: str, process_group: Any = None, names: Optional[Sequence[str]] = None,
                placements: Optional[Mapping[str, Any]] = None,
                corrupt: Optional[Sequence[Sequence[str]]] = None) -> Tuple[str, Dict[str, int]]:
    """Make generation ``name`` loadable on every node (collective): each node gets the files its
    ranks will read to load ``names`` (None: every tensor) under ``placements``; ``corrupt[r]``
    (the same on every rank) names local copies that rank ``r`` found changed, which are not
    used. Returns the checkpoint root to load it from on this rank and what was fetched
    (``{"files": n, "bytes": b}`` for this node). Raises :class:`CheckpointError` on every rank
    alike when it cannot (a local I/O error never leaves a peer waiting); a transport error
    (gloo) escapes."""
    comm = Comm(process_group)
    dirs, invs = gather_inventories(comm)
    if any(d is None for d in dirs):
        raise CheckpointError(f"memory snapshot {name!r}: a rank has no memory tier")
    layout = NodeLayout.from_dirs([d or "" for d in dirs], comm.rank)
    have = [invs[ranks[0]].get(name, {"gen": [], "rep": []}) for ranks in layout.nodes]
    base = snapshot_dir() or ""
    raw = _gather_metadata(comm, name, layout, have, base)
    meta = CheckpointMeta.loads(raw, f"memory snapshot {name}")
    need = _gather_needs(comm, meta, names, placements, layout)
    plan = plan_transfers(name, need, _leave_out(have, layout, corrupt))

    me, leader = layout.me, layout.leader
    restore = os.path.join(ShmLayout(base).restore, name)
    problem: Optional[str] = None
    if leader and not plan.local[me]:
        incoming = len(raw) + sum(meta.files[f].size for f, _s, d in plan.transfers if d == me)
        problem = _prepare_restore(base, name, me, restore, incoming)
    _raise_first(name, comm.all_gather(problem))  # before any transfer: every rank alike

    problems, fetched = _run_transfers(name, meta, plan.transfers, layout, comm, base, restore)
    if leader and not plan.local[me] and not problems:
        problem = _assemble(name, base, restore, sorted(need[me] & plan.present[me]), raw, me)
        if problem:
            problems.append(problem)
    _raise_first(name, comm.all_gather(problems[0] if problems else None))
    root = ShmLayout(base).generations if plan.local[me] else ShmLayout(base).restore
    return root, fetched


def _gather_needs(comm: Comm, meta: CheckpointMeta, names: Optional[Sequence[str]],
                  placements: Optional[Mapping[str, Any]], layout: NodeLayout) -> List[Set[str]]:
    """The files each node's ranks read (collective; see :func:`files_needed`)."""
    try:
        mine = sorted(files_needed(meta, names, placements or {}, comm.rank, comm.world_size))
    except CheckpointError:
        mine = sorted(meta.files)  # the load itself says what is wrong
    wanted = comm.all_gather(mine)
    return [set().union(*(wanted[r] for r in ranks)) for ranks in layout.nodes]


def _gather_metadata(comm: Comm, name: str, layout: NodeLayout, have: List[Dict[str, Any]], base: str) -> bytes:
    """``metadata.json`` of generation ``name`` as the first node that holds any of its files read it
    (collective); raises on every rank alike when no node could."""
    holder = next((ranks[0] for ranks, h in zip(layout.nodes, have) if h["gen"] or h["rep"]), None)
    meta_bytes: Optional[bytes] = None
    if comm.rank == holder:
        p = next((os.path.join(base, sub, name, METADATA_FILE) for sub in (GENERATIONS, REPLICAS)
                  if os.path.exists(os.path.join(base, sub, name, METADATA_FILE))), None)
        try:
            with open(p or "", "rb") as f:
                meta_bytes = f.read()
        except OSError:
            meta_bytes = None
    got = comm.all_gather(meta_bytes if comm.rank == holder else None)
    raw = got[holder] if holder is not None else None
    if raw is None:
        raise CheckpointError(f"memory snapshot {name!r} is no longer in memory")
    return raw


@dataclass(frozen=True)
class TransferPlan:
    """Which nodes load from their own generation (``local``), the files each node holds
    (``present``), and every transfer ``(file, from node, to node)`` in the one global order."""

    local: List[bool]
    present: List[Set[str]]
    transfers: List[Tuple[str, int, int]]


def plan_transfers(name: str, need: Sequence[Set[str]], have: Sequence[Mapping[str, Any]]) -> TransferPlan:
    """The transfers that bring every node the files it ``need``s, from the first node that holds
    each (``have[n]``: node ``n``'s usable ``gen`` and ``rep`` files, and the ``corrupt`` ones it
    left out); computed alike on every rank. Raises when a needed file is on no node."""
    local = [need[n] <= set(h["gen"]) for n, h in enumerate(have)]
    present = [set(h["gen"]) | set(h["rep"]) for h in have]
    transfers: List[Tuple[str, int, int]] = []
    for n in range(len(have)):
        if local[n]:
            continue
        for fname in sorted(need[n] - present[n]):
            src = next((m for m in range(len(have)) if fname in present[m]), None)
            if src is None:
                damaged = [str(m) for m, h in enumerate(have) if fname in h.get("corrupt", ())]
                why = (f"fails its checksum on node {', '.join(damaged)} and no other node holds it" if damaged
                       else "is on no node any more")
                raise CheckpointError(f"memory snapshot {name!r}: {fname} {why}")
            transfers.append((fname, src, n))
    return TransferPlan(local, present, transfers)


def _prepare_restore(base: str, name: str, me: int, restore: str, nbytes: int) -> Optional[str]:
    """On a leader whose node fetches: check its room for ``nbytes`` and create an empty ``restore``."""
    problem = _room_problem(base, name, me, nbytes)
    try:
        shutil.rmtree(restore, ignore_errors=True)
        os.makedirs(restore)
    except OSError as err:
        problem = problem or f"memory snapshot {name!r}: cannot create its restore directory on node {me}: {err}"
    return problem


def _run_transfers(name: str, meta: CheckpointMeta, transfers: List[Tuple[str, int, int]], layout: NodeLayout,
                   comm: Comm, base: str, restore: str) -> Tuple[List[str], Dict[str, int]]:
    """Send and receive this node's share of ``transfers`` (leaders only); returns the problems
    and what this node fetched."""
    me, leader = layout.me, layout.leader
    problems: List[str] = []
    fetched = {"files": 0, "bytes": 0}
    for fname, src, dst in transfers:
        entry = meta.files[fname]
        if not leader or me not in (src, dst):
            continue
        try:  # a failure (a full /dev/shm, a gloo error or time-out) becomes a problem: the collectives stay in step
            if me == src:
                p = send_file(_local_path(base, name, fname), entry.size, layout.nodes[dst][0], comm.group)
            else:
                p = recv_file(os.path.join(restore, fname), entry, layout.nodes[src][0], comm.group)
                fetched["files"] += 1
                fetched["bytes"] += entry.size
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            p = f"{fname}: {describe(err)}"
        if p:
            problems.append(f"memory snapshot {name!r}: {p}")
    return problems, fetched


def _assemble(name: str, base: str, restore: str, held: List[str], raw: bytes, me: int) -> Optional[str]:
    """Link the ``held`` files this node needs into ``restore`` and write its metadata; the problem, if any."""
    try:
        for fname in held:
            src_path = _local_path(base, name, fname)
            if src_path is None:
                raise CheckpointError(f"memory snapshot {name!r}: {fname} vanished from this node")
            os.link(src_path, os.path.join(restore, fname))
        with open(os.path.join(restore, METADATA_FILE), "wb") as f:
            f.write(raw)
    except (OSError, CheckpointError) as err:
        return f"memory snapshot {name!r} cannot be assembled on node {me}: {err}"
    return None


def _raise_first(name: str, problems: List[Optional[str]]) -> None:
    """Raise the first of every rank's problems, on every rank (releasing this node's copy)."""
    for p in problems:
        if p:
            release(name)
            raise CheckpointError(p)


def release(name: str) -> None:
    """Remove ``restore/<name>`` of this node (after the load; loaded maps stay valid)."""
    base = snapshot_dir()
    if base is not None:
        shutil.rmtree(os.path.join(ShmLayout(base).restore, name), ignore_errors=True)


__all__ = ["TransferPlan", "files_needed", "materialize", "plan_transfers", "release"]
