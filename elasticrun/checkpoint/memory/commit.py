"""One memory generation on several nodes: parts per node, one commit marker per node.

The ranks that share a snapshot directory form a *node* (under elasticrun: the ranks of one
agent). Nodes are ordered by their lowest rank (the agents' order in the topology, since
ranks are handed out node by node); the lowest rank of a node is its *leader*.

A generation ``<name>`` is written like a disk save, except that every rank writes its
shard files into its own node's ``generations/.<name>.tmp-<token>/``. After a gather shows
that every rank's part is complete, each node's leader writes ``metadata.json`` — the
GLOBAL metadata, listing every file of every node with its size and checksum — into its
temporary directory and renames it to ``generations/<name>/``. A second gather confirms
every node committed; a node whose commit failed makes every leader withdraw its commit.
A crash anywhere leaves at worst a temporary directory (never loaded) or a generation that
is committed on some nodes only: its other files are missing everywhere, so restore skips it.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

from elasticrun.checkpoint.checksum import MEMORY_CHECKSUM
from elasticrun.checkpoint.commit import commit, crash_point, rollback
from elasticrun.checkpoint.format import METADATA_FILE, CheckpointMeta, FileEntry, parse_tmp_dir_name
from elasticrun.checkpoint.temps import write_marker
from elasticrun.checkpoint.writer import SaveJob, files_of_results
from elasticrun.errors import CheckpointError

_STEP_RE = re.compile(r"^snap-(\d+)-")


@dataclass
class NodeLayout:
    """Which ranks (of the snapshot's process group) share a snapshot directory."""

    nodes: List[List[int]]  # ranks per node; nodes ordered by their lowest rank
    rank: int

    @classmethod
    def from_dirs(cls, dirs: Sequence[str], rank: int) -> NodeLayout:
        """``dirs[r]``: the (real) snapshot directory of rank ``r``."""
        by_dir: dict = {}
        for r, d in enumerate(dirs):
            by_dir.setdefault(d, []).append(r)
        return cls(sorted(by_dir.values(), key=lambda ranks: ranks[0]), rank)

    @property
    def me(self) -> int:
        """This rank's node index."""
        return self.node_of(self.rank)

    @property
    def leader(self) -> bool:
        """Whether this rank is its node's leader (commits, replicates, fetches for the node)."""
        return self.nodes[self.me][0] == self.rank

    def node_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    def successor(self, node: int) -> int:
        """The node that holds ``node``'s replicas (the next one on the ring)."""
        return (node + 1) % len(self.nodes)

    def predecessor(self, node: int) -> int:
        """The node whose replicas ``node`` holds."""
        return (node - 1) % len(self.nodes)

    def files_of_node(self, meta: CheckpointMeta, node: int) -> List[FileEntry]:
        """The files of a generation that ``node``'s ranks wrote, in name order."""
        ranks = set(self.nodes[node])
        return [e for _n, e in sorted(meta.files.items()) if e.rank in ranks]


@dataclass
class NodeSaveJob(SaveJob):
    """A :class:`SaveJob` whose commit happens on every node's leader (see the module doc)."""

    layout: Optional[NodeLayout] = field(default=None)

    def run(self) -> str:
        assert self.layout is not None
        crash_point("start", self.comm.rank)
        if self.layout.leader and not self.error:
            self._make_tmp()
        results = self.comm.all_gather(self._write_phase())
        self._raise_if_write_failed(results)
        status = self._commit_on_leader(results) if self.layout.leader else {}
        self._confirm_commit(status)
        if self.layout.leader and self.keep_last is not None:
            retain(self.storage.root, self.keep_last, protect=self.name)
        return self.name

    def _make_tmp(self) -> None:
        try:
            self.storage.mkdirs(self.tmp)
            write_marker(self.storage, self.tmp)  # so a torn one is reclaimed on this node too
        except OSError as err:
            self.error = f"cannot create {self.tmp}: {err}"

    def _raise_if_write_failed(self, results: Sequence[dict]) -> None:
        failed = first_error(results)
        if failed is None:
            return
        assert self.layout is not None
        note = rollback(self.storage, self.tmp) if self.layout.leader else "it was rolled back"
        r, msg = failed
        where = f" on rank {r}" if self.comm.world_size > 1 else ""
        raise CheckpointError(f"snapshot {self.name!r} failed{where}: {msg}; {note}")

    def _commit_on_leader(self, results: Sequence[dict]) -> dict:
        """Write the global metadata into this node's temporary directory and rename it."""
        try:
            meta = CheckpointMeta(
                name=self.name, world_size=self.comm.world_size, created=self.created, tensors=self.plan.tensors,
                files=files_of_results(results), tree=self.tree, training_state=self.training_state,
                user_metadata=self.user_metadata, seq=int(self.created * 1000),  # the same on every node
            )
            commit(self.storage, self.tmp, self.final, meta.dumps(), self.comm.rank)
            return {"ok": True}
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            return {"error": f"{err}; {rollback(self.storage, self.tmp)}"}

    def _confirm_commit(self, status: dict) -> None:
        """Gather every node's commit status; withdraw this node's commit unless all succeeded."""
        try:
            statuses = self.comm.all_gather(status)
        except CheckpointError:
            if status.get("ok"):
                shutil.rmtree(self.final, ignore_errors=True)  # a peer died: this generation cannot complete
            raise
        bad = first_error(statuses)
        if bad:
            if status.get("ok"):
                shutil.rmtree(self.final, ignore_errors=True)  # withdraw: another node could not commit
            r, msg = bad
            raise CheckpointError(f"committing snapshot {self.name!r} failed on rank {r}: {msg}")


def first_error(replies: Sequence[dict]) -> Optional[Tuple[int, str]]:
    """``(rank, error)`` of the lowest rank whose gathered reply carries an ``"error"``, or None."""
    return next(((r, reply["error"]) for r, reply in enumerate(replies) if "error" in reply), None)


def generation_step(name: str) -> int:
    """The training step in a generation's name (``snap-<step>-<ms>``), or -1."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else -1


def committed(root: str) -> List[Tuple[int, float, str]]:
    """``[(step, commit time, name)]`` of the committed generations in ``root``, oldest first."""
    out = []
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for n in names:
        if parse_tmp_dir_name(n) is not None:
            continue
        try:
            t = os.stat(os.path.join(root, n, METADATA_FILE)).st_mtime
        except OSError:
            continue
        out.append((generation_step(n), t, n))
    return sorted(out)


def retain(root: str, keep: int, protect: Optional[str] = None) -> List[str]:
    """Remove the committed generations (or replicas) of ``root`` beyond the newest ``keep``:
    commit marker first, then the files. Returns the names removed."""
    doomed = [n for _s, _t, n in committed(root)[:-keep] if n != protect] if keep > 0 else []
    for n in doomed:
        path = os.path.join(root, n)
        try:
            os.unlink(os.path.join(path, METADATA_FILE))
        except OSError:
            pass
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def to_node_job(job: SaveJob, layout: NodeLayout) -> NodeSaveJob:
    """The prepared ``job`` as a per-node job, its files hashed with the memory tier's checksum
    (``wordsum``: a restore checks every byte it copies at memory speed)."""
    kwargs: Any = {f: getattr(job, f) for f in job.__dataclass_fields__}
    kwargs["checksum"] = MEMORY_CHECKSUM
    return NodeSaveJob(**kwargs, layout=layout)


__all__ = ["NodeLayout", "NodeSaveJob", "committed", "first_error", "generation_step", "retain", "to_node_job"]
