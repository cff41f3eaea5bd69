"""Memory snapshots: the checkpoint format, written to the node's shared memory.

    from elasticrun.checkpoint import Snapshotter
    snaps = Snapshotter(process_group=pg, persist_to="ckpts", persist_every=10)
    snaps.snapshot(state, training_state=ts)      # every few steps: milliseconds, not a disk write
    ...
    ckpt = elasticrun.train.load_latest("ckpts", ...)   # newest of memory and disk

Under elasticrun the agent owns a 0700 directory in ``/dev/shm`` (``ELASTICRUN_SNAPSHOT_DIR``,
see :mod:`elasticrun.launch.shmroot`) that outlives its workers: a worker that crashes and
is restarted finds the snapshots of its predecessor there. Each snapshot is a *generation*:
a checkpoint in exactly the disk format (sharded safetensors, a checksum per file,
``metadata.json`` written last and renamed into place), committed only when every rank's
part is complete — a crash in the middle leaves a temporary directory that is never loaded.
The newest ``keep`` generations are kept (default 2). Every ``persist_every``-th generation
is also copied by rank 0 to the disk root on a background thread (hard links pin it first,
so retention cannot pull it away mid-copy), with the same atomic commit as a save.

Several nodes: the ranks sharing a snapshot directory form a node; each node holds the parts
its ranks wrote, committed by the node's leader with the generation's global metadata
(:mod:`elasticrun.checkpoint.memory.commit`), and a replica of its ring predecessor's parts
(:mod:`elasticrun.checkpoint.memory.replicas`). ``load_latest`` restores from the union of all
nodes' memory at any world size (:mod:`elasticrun.checkpoint.memory.fetch`). Persistence to
disk needs every file on rank 0's node: on several nodes it is skipped (with a warning).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, Mapping, Optional, Union

from elasticrun.checkpoint.comm import Comm
from elasticrun.checkpoint.format import Placement, parse_tmp_dir_name
from elasticrun.checkpoint.memory.budget import SnapshotUnavailable, plan_memory
from elasticrun.checkpoint.memory.commit import NodeLayout, to_node_job
from elasticrun.checkpoint.memory.persist import persist_generation
from elasticrun.errors import CheckpointError
from elasticrun.job import env as env_names
from elasticrun.job.shm import TRANSIENT, ShmLayout, snapshot_dir

log = logging.getLogger(__name__)

DEFAULT_KEEP = 2


class Snapshotter:
    """Takes memory snapshots for one process group; optionally async, replicated, persisted.

    ``base``: the snapshot directory (default ``ELASTICRUN_SNAPSHOT_DIR``); ``keep``: how many
    generations stay in memory; ``persist_to``/``persist_every``: every K-th generation is
    copied to that disk root in the background — by rank 0 on one node, by every node's leader
    (its own parts, after the replica) on several (``persist_keep_last`` applies retention
    there); ``async_snapshots``: the call returns once the state is copied to host buffers
    reused across snapshots (pinned, on a side stream, for CUDA tensors);
    ``replicate`` (default): on several nodes, each generation's parts are also copied in the
    background to the next node's memory (``replicas/``), so losing a node loses no part.
    """

    def __init__(self, process_group: Any = None, *, base: Optional[str] = None, keep: int = DEFAULT_KEEP,
                 persist_to: Optional[str] = None, persist_every: int = 0,
                 persist_keep_last: Optional[int] = None, async_snapshots: bool = False,
                 replicate: bool = True) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise CheckpointError(f"keep must be a positive integer (got {keep!r})")
        self.process_group = process_group
        self.base = base or snapshot_dir()
        self.keep = keep
        self.persist_to = persist_to
        self.persist_every = persist_every if persist_to else 0
        self.persist_keep_last = persist_keep_last
        self.replicate = replicate
        self.count = 0
        self.generation_bytes = 0
        self.layout: Optional[NodeLayout] = None
        self._due = False
        self._async: Any = None
        if async_snapshots:
            from elasticrun.checkpoint.memory.pinned import PinnedAsyncCheckpointer

            self._async = PinnedAsyncCheckpointer(process_group)
        self._replicator: Any = None
        self._persist_pool: Optional[ThreadPoolExecutor] = None
        self._persist: Optional[Future] = None
        self._warned = False
        self._lock = threading.Lock()

    @property
    def root(self) -> str:
        if self.base is None:
            raise SnapshotUnavailable(
                f"no memory tier: {env_names.SNAPSHOT_DIR} is not set (run under elasticrun on Linux, or pass base=)"
            )
        return ShmLayout(self.base).generations

    def snapshot(self, state_dict: Mapping[str, Any], *, training_state: Any = None,
                 placements: Optional[Mapping[str, Placement]] = None) -> Union[str, Any]:
        """Write a generation (collective). Sync: returns its name once committed. Async: returns
        an :class:`~elasticrun.checkpoint.background.AsyncSaveHandle` once the state is copied."""
        from elasticrun.checkpoint.writer import prepare, training_state_dict

        comm = Comm(self.process_group)
        extra = 1 if self.persist_every else 0
        self.generation_bytes, layout = plan_memory(state_dict, placements, comm, self.base, self.keep + 1 + extra)
        self.layout = layout
        if self.count == 0 and layout.leader and self.base is not None:
            self._reclaim(ShmLayout(self.base).generations)
        root = self.root
        ts = training_state_dict(training_state)
        step = ts.get("step") if ts else None
        name = (f"snap-{step:08d}-" if isinstance(step, int) else "snap-") + f"{int(time.time() * 1000) % 10**10}"
        self.count += 1
        if self.persist_every and self.count % self.persist_every == 0:
            self._due = True
        replicas = self.replicate and len(layout.nodes) > 1
        if replicas and self._replicator is None:
            from elasticrun.checkpoint.memory.replicas import Replicator

            self._replicator = Replicator(self.process_group, self.base or "", self.keep)  # collective
        persist = None
        if replicas and self._due:  # several nodes: persisted by every node after the replica, in order
            persist, self._due = (self.persist_to, self.persist_keep_last), False
        if self._async is not None:
            handle = self._async.save(state_dict, root, name, training_state=ts, placements=placements,
                                      keep_last=self.keep, layout=layout)
            if replicas:
                self._replicator.submit(handle, layout, persist)
            self._maybe_persist(comm, handle)
            return handle
        job, tensors = prepare(state_dict, root, name, comm, training_state=ts, placements=placements,
                               keep_last=self.keep)
        job = to_node_job(job, layout)
        try:
            job.take_sources(tensors)  # as save(): CUDA tensors through pinned buffers, overlapped
        except Exception as err:  # noqa: BLE001 - must still take part in the collectives
            job.sources, job.error = [], f"cannot read the tensors to snapshot: {err}"
        done = job.run()
        if replicas:
            self._replicator.submit(done, layout, persist)
        self._maybe_persist(comm, None, done)
        return done

    def _reclaim(self, root: str) -> None:
        """First snapshot of this process: free the shared memory that crashed predecessors left —
        temporary directories of torn generations (their writers are dead), persist staging, replica
        sends and restore copies."""
        from elasticrun.checkpoint.storage import get_storage
        from elasticrun.checkpoint.temps import reclaim_stale_temps

        if os.path.isdir(root):
            reclaim_stale_temps(get_storage(root))
        for leftover in TRANSIENT:  # transient dirs of a dead predecessor
            shutil.rmtree(os.path.join(self.base or "", leftover), ignore_errors=True)
        replicas = ShmLayout(self.base or "").replicas
        for entry in os.listdir(replicas) if os.path.isdir(replicas) else []:
            if parse_tmp_dir_name(entry) is not None:  # a replica whose receipt a crash interrupted
                shutil.rmtree(os.path.join(replicas, entry), ignore_errors=True)

    def _maybe_persist(self, comm: Comm, handle: Any, name: Optional[str] = None) -> None:
        if not self._due or comm.rank != 0:
            return
        if self.layout is not None and len(self.layout.nodes) > 1:
            self._due = False
            if not self._warned:
                self._warned = True
                log.warning("memory snapshots are not persisted to %s: the job spans %d nodes and replicate=False "
                            "(several nodes persist after their replica); use disk checkpoints too",
                            self.persist_to, len(self.layout.nodes))
            return
        with self._lock:
            if self._persist is not None and not self._persist.done():
                return  # the previous copy still runs: persist a later generation instead
            self._due = False
            if self._persist_pool is None:
                self._persist_pool = ThreadPoolExecutor(1, thread_name_prefix="snapshot-persist")
            staged = None if handle is not None else self._stage(name or "")
            self._persist = self._persist_pool.submit(self._persist_job, handle, name, staged)

    def _stage(self, name: str) -> str:
        """Hard-link the committed generation's files aside, so retention cannot take them mid-copy."""
        src = os.path.join(self.root, name)
        stage = os.path.join(ShmLayout(self.base or "").persist, name)
        shutil.rmtree(stage, ignore_errors=True)
        os.makedirs(stage)
        for f in os.listdir(src):
            os.link(os.path.join(src, f), os.path.join(stage, f))
        return stage

    def _persist_job(self, handle: Any, name: Optional[str], staged: Optional[str]) -> Optional[str]:
        try:
            if handle is not None:
                name = handle.result()
                staged = self._stage(name)
            assert name is not None and staged is not None and self.persist_to is not None
            t0 = time.perf_counter()
            persist_generation(staged, name, self.persist_to, self.persist_keep_last)
            log.info("snapshot %s persisted to %s in %.2fs", name, self.persist_to, time.perf_counter() - t0)
            return name
        except Exception as err:  # noqa: BLE001 - a failed copy must not stop training; the next one retries
            log.warning("snapshot %s was not persisted: %s", name, err)
            return None
        finally:
            if staged:
                shutil.rmtree(staged, ignore_errors=True)

    def wait(self) -> Optional[str]:
        """Wait for the async snapshot, its replica and the disk copy in flight; the name persisted
        last (or None). Replicas are not waited for once a re-form destroyed the process group (a
        transfer under way cannot end then; :meth:`close` cuts it)."""
        if self._async is not None:
            self._async.wait()
        if self._replicator is not None:
            self._replicator.wait()
        fut = self._persist
        if fut is None and self._replicator is not None:
            return self._replicator.persisted
        return fut.result() if fut is not None else None

    def close(self) -> None:
        """Wait for everything in flight and stop the background threads. Replicas are not waited for once
        the process group was destroyed (after an in-place re-form: close the old round's snapshotter and
        make a new one); their transfers are cut (:meth:`Replicator.close`)."""
        try:
            if self._async is not None:
                self._async.wait()
        finally:
            try:
                if self._replicator is not None:
                    self._replicator.close()
                if self._persist is not None:
                    self._persist.result()
            finally:
                if self._async is not None:
                    self._async.close()
                if self._persist_pool is not None:
                    self._persist_pool.shutdown(wait=True)


_DEFAULT: Dict[int, Snapshotter] = {}


def snapshot(state_dict: Mapping[str, Any], *, training_state: Any = None,
             placements: Optional[Mapping[str, Placement]] = None, process_group: Any = None) -> str:
    """Write a memory snapshot generation now (collective; synchronous); returns its name.

    Same ``state_dict``/``training_state``/``placements`` as :func:`elasticrun.checkpoint.save`;
    keeps the last two generations. Use :class:`Snapshotter` for async snapshots and
    persistence to disk. Raises :class:`SnapshotMemoryError` when shared memory is too small.
    """
    snaps = _DEFAULT.get(id(process_group))
    if snaps is None:
        snaps = _DEFAULT[id(process_group)] = Snapshotter(process_group)
    return snaps.snapshot(state_dict, training_state=training_state, placements=placements)


__all__ = ["DEFAULT_KEEP", "Snapshotter", "snapshot"]
