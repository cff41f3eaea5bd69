"""Peer replicas of memory generations, and the byte transport they share with restore.

After a generation commits, each node's leader sends its node's parts to the next node on
the ring (nodes ordered by their lowest rank, see :class:`~.commit.NodeLayout`),
which stores them under ``<snapshot dir>/replicas/<name>/`` with the generation's global
``metadata.json`` and a ``replica.json`` (which node they came from). Every file's checksum
is checked on receipt, before the directory is renamed into place, so a replica that exists
is whole and verified; the newest ``keep`` replicas are kept.

Transport: a private gloo group made once by the :class:`Replicator` (collectively, on the
snapshot's main thread) and used only by its one background thread: point-to-point
send/recv of file bytes in chunks. Each leader posts its sends (``isend``) before its
receives, chunk by chunk, so a ring of any size cannot deadlock. A re-form destroys the group under
a transfer that one side had begun and the other never will: closing the replicator then cuts the
group's connections, so that neither side waits for :data:`TIMEOUT`. Nothing is exposed on the
network beyond the job's own process group. Why not agent-to-agent: the workers already
hold an authenticated-by-membership gloo mesh; an agent transport would need its own
listener, authentication and flow control.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import shutil
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from elasticrun.checkpoint.checksum import Digest
from elasticrun.checkpoint.commit import new_token
from elasticrun.checkpoint.format import METADATA_FILE, CheckpointMeta, FileEntry, tmp_dir_name
from elasticrun.checkpoint.memory.commit import NodeLayout, retain
from elasticrun.checkpoint.memory.restore import files_digest
from elasticrun.errors import CheckpointError
from elasticrun.job import env as env_names
from elasticrun.job.shm import ShmLayout
from elasticrun.sockets import OpenedSockets

log = logging.getLogger(__name__)

REPLICA_FILE = "replica.json"
CHUNK = 64 << 20
#: How long a replica transfer waits for its peer before giving up (seconds).
TIMEOUT = float(os.environ.get(env_names.SNAPSHOT_REPLICA_TIMEOUT, "300"))
#: How long :meth:`Replicator.close` waits for its thread once the transfers ended or were cut.
JOIN_S = 5.0
WAIT_SLICE_S = 0.25  # how often a wait asks whether a re-form destroyed the group


def _global(group: Any, rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


def _chunks(size: int) -> List[Tuple[int, int]]:
    return [(a, min(CHUNK, size - a)) for a in range(0, size, CHUNK)]


def send_file(path: Optional[str], size: int, dst: int, group: Any) -> Optional[str]:
    """Send ``size`` bytes of ``path`` to group rank ``dst`` (blocking, chunked). A missing or
    short file is padded with zeros (the receiver's checksum check fails: it never hangs);
    returns that problem or None."""
    import torch.distributed as dist

    problem = None
    try:
        f: Any = open(path, "rb") if path else None  # noqa: SIM115 - closed below
    except OSError as err:
        f, problem = None, f"{path}: {err}"
    try:
        for _off, n in _chunks(size):
            buf = bytearray(n)
            if f is None or f.readinto(buf) != n:
                problem = problem or f"{path} is missing or shorter than {size} bytes"
            dist.send(torch.frombuffer(buf, dtype=torch.uint8), dst=_global(group, dst), group=group)
    finally:
        if f is not None:
            f.close()
    return problem


def recv_file(path: str, entry: FileEntry, src: int, group: Any) -> Optional[str]:
    """Receive ``entry.size`` bytes from group rank ``src`` into ``path``; the problem or None
    (its checksum checked against ``entry``). A local write error (a full ``/dev/shm``) still
    receives every byte, so the sender and later transfers stay in step; the file is removed."""
    import torch.distributed as dist

    sink = FileSink(os.path.dirname(path), [entry])
    try:
        for _off, n in _chunks(entry.size):
            t = torch.empty(n, dtype=torch.uint8)
            dist.recv(t, src=_global(group, src), group=group)
            sink(0, memoryview(t.numpy()).cast("B"))
    finally:
        sink.close()
    problem = sink.problem([entry])
    if problem:
        sink.discard()
    return problem


class FileSink:
    """Writes received files into ``folder`` while hashing them; a write error is remembered
    (later bytes are hashed and dropped) rather than raised, so a transfer is always drained."""

    def __init__(self, folder: str, entries: Sequence[FileEntry]) -> None:
        self.folder, self.entries = folder, list(entries)
        self.hashes = [Digest(e.algo) for e in entries]
        self.handles: dict = {}
        self.error: Optional[str] = None

    def __call__(self, i: int, data: memoryview) -> None:
        self.hashes[i].update(data)
        if self.error is not None:
            return
        try:
            f = self.handles.get(i) or self.handles.setdefault(
                i, open(os.path.join(self.folder, self.entries[i].name), "wb"))  # noqa: SIM115 - closed by close()
            f.write(data)
        except OSError as err:
            self.error = f"cannot store {self.entries[i].name}: {err.strerror or err}"

    def close(self) -> None:
        for f in self.handles.values():
            try:
                f.close()
            except OSError as err:
                self.error = self.error or f"cannot store a received file: {err.strerror or err}"
        self.handles.clear()

    def problem(self, expected: Sequence[FileEntry]) -> Optional[str]:
        """The write error, or the first file whose checksum differs from ``expected`` (same order)."""
        if self.error:
            return self.error
        for e, h in zip(expected, self.hashes):
            if h.hexdigest() != e.digest:
                return f"{e.name} arrived corrupt ({e.algo.value} mismatch)"
        return None

    def discard(self) -> None:
        for e in self.entries:
            try:
                os.unlink(os.path.join(self.folder, e.name))
            except OSError:
                pass


def exchange(group: Any, dst: Optional[int], outgoing: Sequence[Tuple[str, int]], src: Optional[int],
             incoming: Sequence[int], sink: Callable[[int, memoryview], None], tag: int = 0) -> None:
    """Send the files ``outgoing`` ([(path, size)]) to ``dst`` while receiving ``incoming``
    (sizes) from ``src``: per chunk, the send is posted before the receive (deadlock-free on a
    ring). ``sink(file index, bytes)`` gets the received bytes in order. ``tag`` keeps this
    exchange's messages apart from any other's (e.g. one an error cut short)."""
    import torch.distributed as dist

    sends = [(path, off, n) for path, size in outgoing for off, n in _chunks(size)]
    recvs = [(i, n) for i, size in enumerate(incoming) for _off, n in _chunks(size)]
    files: dict = {}
    try:
        for k in range(max(len(sends), len(recvs))):
            work = None
            if k < len(sends) and dst is not None:
                path, off, n = sends[k]
                f = files.get(path) or files.setdefault(path, open(path, "rb"))  # noqa: SIM115 - closed below
                buf = bytearray(n)
                f.seek(off)
                if f.readinto(buf) != n:
                    raise CheckpointError(f"{path} is shorter than expected")
                work = dist.isend(torch.frombuffer(buf, dtype=torch.uint8), dst=_global(group, dst), group=group,
                                  tag=tag)
            if k < len(recvs) and src is not None:
                i, n = recvs[k]
                t = torch.empty(n, dtype=torch.uint8)
                dist.recv(t, src=_global(group, src), group=group, tag=tag)
                sink(i, memoryview(t.numpy()).cast("B"))
            if work is not None:
                work.wait()
    finally:
        for f in files.values():
            f.close()


def _send_header(group: Any, dst: Optional[int], src: Optional[int], meta: Optional[bytes],
                 tag: int = 0) -> Optional[bytes]:
    """Exchange ``[ok, len(metadata)]`` + metadata bytes with the ring neighbours; the predecessor's
    metadata (None when it has nothing to send)."""
    import torch.distributed as dist

    head = torch.tensor([1 if meta else 0, len(meta or b"")], dtype=torch.int64)
    work = dist.isend(head, dst=_global(group, dst), group=group, tag=tag) if dst is not None else None
    theirs = torch.zeros(2, dtype=torch.int64)
    if src is not None:
        dist.recv(theirs, src=_global(group, src), group=group, tag=tag)
    if work is not None:
        work.wait()
    body_work, out = None, torch.frombuffer(bytearray(meta or b"\0"), dtype=torch.uint8)
    if dst is not None and meta:
        body_work = dist.isend(out, dst=_global(group, dst), group=group, tag=tag)
    got: Optional[bytes] = None
    if src is not None and int(theirs[0]):
        body = torch.empty(int(theirs[1]), dtype=torch.uint8)
        dist.recv(body, src=_global(group, src), group=group, tag=tag)
        got = bytes(body.numpy())
    if body_work is not None:
        body_work.wait()
    return got


def _expected(own: Optional[CheckpointMeta], sent: CheckpointMeta, layout: NodeLayout,
              entries: List[FileEntry]) -> Tuple[List[FileEntry], Optional[str]]:
    """The entries to check the received files against: this node's own copy of the
    generation's metadata (committed here by the same collective), not only the sender's."""
    if own is None:
        return entries, "this node has no copy of the generation's metadata to check it against"
    mine = layout.files_of_node(own, layout.predecessor(layout.me))
    if files_digest(own) != files_digest(sent) or [e.name for e in mine] != [e.name for e in entries]:
        return entries, "the sender's metadata differs from this node's copy"
    return mine, None


def replicate_generation(base: str, name: str, layout: NodeLayout, group: Any, keep: int,
                         tag: int = 0) -> Optional[str]:
    """Leaders only, on every leader at once: send this node's parts of ``name`` to the next node
    and store the previous node's parts as a replica. Returns the replica's name or None.
    A failed receipt (a write error, a checksum that differs from this node's own metadata)
    still drains the transfer, so the pair stays in step, and leaves no temporary directory;
    ``tag`` (the same on both sides) keeps a transfer that a transport error cut short from
    mixing with the next one."""
    me = layout.me
    if len(layout.nodes) < 2 or not layout.leader:
        return None
    dst, src = layout.nodes[layout.successor(me)][0], layout.nodes[layout.predecessor(me)][0]
    gen = os.path.join(ShmLayout(base).generations, name)
    stage = os.path.join(ShmLayout(base).outgoing, name)
    meta_bytes: Optional[bytes] = None
    own: Optional[CheckpointMeta] = None
    outgoing: List[Tuple[str, int]] = []
    try:  # hard links pin the files: retention may remove the generation meanwhile
        shutil.rmtree(stage, ignore_errors=True)
        os.makedirs(stage)
        with open(os.path.join(gen, METADATA_FILE), "rb") as f:
            meta_bytes = f.read()
        own = CheckpointMeta.loads(meta_bytes, gen)
        for e in layout.files_of_node(own, me):
            os.link(os.path.join(gen, e.name), os.path.join(stage, e.name))
            outgoing.append((os.path.join(stage, e.name), e.size))
    except (OSError, CheckpointError) as err:
        log.warning("snapshot %s is gone before its replica was sent (%s): skipped", name, err)
        meta_bytes, outgoing = None, []
    root = ShmLayout(base).replicas
    tmp = os.path.join(root, tmp_dir_name(name, new_token()))
    try:
        theirs = _send_header(group, dst, src, meta_bytes, tag)
        sent = CheckpointMeta.loads(theirs, f"replica of {name}") if theirs else None
        entries = layout.files_of_node(sent, layout.predecessor(me)) if sent is not None else []
        sink = FileSink(tmp, entries)
        if entries:
            try:
                os.makedirs(tmp)
            except OSError as err:
                sink.error = f"cannot create {tmp}: {err.strerror or err}"
        try:
            exchange(group, dst if outgoing else None, outgoing, src if entries else None,
                     [e.size for e in entries], sink, tag)
        finally:
            sink.close()
        if sent is None or not entries:
            return None
        expected, mismatch = _expected(own, sent, layout, entries)
        problem = mismatch or sink.problem(expected)
        if problem:
            raise CheckpointError(f"replica of {name} from node {layout.predecessor(me)} rejected: {problem}")
        with open(os.path.join(tmp, REPLICA_FILE), "w", encoding="utf-8") as f:
            json.dump({"from_node": layout.predecessor(me), "to_node": me,
                       "files": [e.name for e in entries]}, f)
        with open(os.path.join(tmp, METADATA_FILE), "wb") as f:
            f.write(meta_bytes or b"")  # this node's own copy: the one the files were checked against
        final = os.path.join(root, name)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        retain(root, keep, protect=name)
        return name
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)


class Replicator:
    """Replicates committed generations to the ring neighbour on one background thread."""

    def __init__(self, process_group: Any, base: str, keep: int) -> None:
        import torch.distributed as dist

        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        self._sockets = OpenedSockets()  # the group's connections, cut when a transfer cannot end (close)
        with self._sockets.watch():
            # Collective (every rank of the job calls it, in the same order as other groups).
            self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT))
        self.base, self.keep = base, keep
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Condition()
        self._pending = 0
        self.last: Optional[str] = None
        self.persisted: Optional[str] = None  # the generation persisted to disk last (rank 0)
        self.errors: List[str] = []
        self._seq = 0  # generations handled: the same count on every rank (each submits the same ones)
        self._thread = threading.Thread(target=self._loop, name="snapshot-replicas", daemon=True)
        self._thread.start()

    def submit(self, name_or_handle: Any, layout: NodeLayout,
               persist: Optional[Tuple[str, Optional[int]]] = None) -> None:
        """Queue a generation (its name, or the async handle that will commit it). Every rank
        submits the same generations in the same order (non-leaders skip them). ``persist``:
        ``(disk root, keep_last)`` to also copy this generation to disk afterwards (collective)."""
        with self._idle:
            self._pending += 1
        self._queue.put((name_or_handle, layout, persist))

    def _loop(self) -> None:
        from elasticrun.checkpoint.memory.persist import persist_across_nodes

        while True:
            item = self._queue.get()
            if item is None:
                return
            what, layout, persist = item
            name: Optional[str] = None
            self._seq += 1
            try:
                name = what if isinstance(what, str) else what.result()
                got = replicate_generation(self.base, name, layout, self.group, self.keep, tag=self._seq % (1 << 24))
                if got:
                    self.last = got
            except Exception as err:  # noqa: BLE001 - a lost replica must not stop training
                self.errors.append(str(err))
                log.warning("snapshot replica failed: %s", err)
            try:
                if persist is not None and name is not None:  # the commit is collective: all ranks have it
                    done = persist_across_nodes(self.base, name, layout, self.group, *persist)
                    if done:
                        self.persisted = done
            except Exception as err:  # noqa: BLE001 - a failed disk copy must not stop training
                self.errors.append(str(err))
                log.warning("snapshot %s was not persisted: %s", name, err)
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued generation is replicated (or failed); False on timeout, and at once when the
        group was destroyed (a re-form): a transfer under way then cannot end (see :meth:`close`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
                if left <= 0 or self.group_destroyed():
                    return False
                self._idle.wait(left)
            return True

    def group_destroyed(self) -> bool:
        """Whether the group was destroyed (an in-place re-form destroys every group of the old round)."""
        import torch.distributed as dist

        try:
            dist.get_process_group_ranks(self.group)
        except (KeyError, ValueError, RuntimeError):  # torch 2.13: KeyError; older: "not registered" errors
            return True
        return False

    def close(self, timeout: float = 60.0) -> None:
        """Stop once the queued replicas are sent (waiting at most ``timeout`` s: a peer may be gone). When the
        group was destroyed meanwhile (a re-form) nothing is waited for: a transfer under way then cannot end,
        since its peer's next call on the destroyed group fails. A transfer still under way is cut (the group's
        connections are shut down: both sides fail at once) instead of holding its peer for :data:`TIMEOUT`."""
        if not self.wait(min(timeout, TIMEOUT)):  # returns at once on a destroyed group
            cut = self._sockets.cut()
            log.warning("snapshot replicas: %d transfer(s) could not end on %s group; %d connection(s) cut",
                        self._pending, "a destroyed" if self.group_destroyed() else "their", cut)
        self._queue.put(None)
        self._thread.join(JOIN_S)


__all__ = ["REPLICA_FILE", "FileSink", "Replicator", "exchange", "recv_file", "replicate_generation", "send_file"]
