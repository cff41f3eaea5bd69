"""Asynchronous saves: the training step is blocked only while the state is copied to
host memory; writing, hashing and the commit run on a background thread. GPU tensors are
copied into pinned buffers on a side stream (that first waits for the training's stream),
so the stall is the device-to-host copy at full speed.

One save is in flight at a time per :class:`AsyncCheckpointer`: the next ``save`` (or
``wait``/``close``, or interpreter exit) waits for it, and an error of a background save
is raised by that next call. Each rank copies only the bytes it will write (about 1/N
of the replicated state), into buffers reused across saves, so only the first save pays
for first-touch page faults. Collectives of the background thread run on a private gloo
group, so they never interleave with the training's own collectives.
"""

from __future__ import annotations

import atexit
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from elasticrun.checkpoint.comm import Comm, private_group
from elasticrun.checkpoint.writer import prepare
from elasticrun.errors import CheckpointError

log = logging.getLogger(__name__)


class AsyncSaveHandle:
    """A save running in the background."""

    def __init__(self, name: str, future: Future) -> None:
        self.name = name
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> str:
        """Wait for the commit; returns the name or raises the save's CheckpointError."""
        return self._future.result(timeout)


class AsyncCheckpointer:
    """Runs saves in the background, one at a time, reusing its host-memory snapshot buffers."""

    def __init__(self, process_group: Any = None) -> None:
        self._process_group = process_group
        self._group: Any = None
        self._group_ready = False
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-async")
        self._pending: Optional[AsyncSaveHandle] = None
        self._buffers: Dict[str, torch.Tensor] = {}
        self._d2h_streams: Dict[torch.device, Any] = {}
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self._atexit)

    def _snapshot(self, key: str, src: torch.Tensor) -> torch.Tensor:
        """Copy ``src`` into this key's reusable host buffer. CUDA tensors go into pinned buffers
        with ``non_blocking`` copies on a side stream; :meth:`_snapshots_done` waits for them."""
        cuda = src.device.type == "cuda"
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != src.dtype or buf.shape != src.shape or (cuda and not buf.is_pinned()):
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=cuda)
            self._buffers[key] = buf
        if not cuda:
            buf.copy_(src.detach())
            return buf
        stream = self._d2h_streams.get(src.device)
        if stream is None:
            stream = self._d2h_streams[src.device] = torch.cuda.Stream(src.device)
        stream.wait_stream(torch.cuda.current_stream(src.device))  # the copy sees the finished step
        with torch.cuda.stream(stream):
            buf.copy_(src.detach(), non_blocking=True)
        return buf

    def _stage(self, writes: Any, tensors: Mapping[str, torch.Tensor]) -> List[Tuple[Any, torch.Tensor]]:
        """Snapshot this rank's write items (``(chunk, host copy)`` pairs, buffers reused by key) and
        drop the buffers no item uses any more (e.g. after the world size changed)."""
        sources = []
        used = set()
        for item in writes:
            src = tensors[item.name]
            if item.rows is not None:
                src = src[item.rows[0]:item.rows[1]]
            key = f"{item.name}@{item.rows}"
            used.add(key)
            sources.append((item.chunk, self._snapshot(key, src)))
        self._snapshots_done()
        for key in [k for k in self._buffers if k not in used]:
            del self._buffers[key]
        return sources

    def _snapshots_done(self) -> None:
        """Wait for the device-to-host copies queued by :meth:`_snapshot` (the training's stall)."""
        for stream in self._d2h_streams.values():
            stream.synchronize()

    def save(
        self,
        state_dict: Mapping[str, Any],
        root: str,
        name: Optional[str] = None,
        **options: Any,
    ) -> AsyncSaveHandle:
        """Snapshot ``state_dict`` and save it in the background.

        ``options`` are the keywords of :func:`elasticrun.checkpoint.save` (``training_state``,
        ``user_metadata``, ``placements``, ``keep_last``, ``storage_options``, ``io_threads``,
        ``checksum``), with the meaning they have there; the process group is the checkpointer's.
        Waits for the previous save first and raises its error, if it failed."""
        if self._closed:
            raise CheckpointError("this AsyncCheckpointer is closed: create a new one")
        self.wait()
        comm = self._comm()
        if "process_group" in options:
            raise TypeError("AsyncCheckpointer.save() takes no process_group: pass it to AsyncCheckpointer()")
        job, tensors = prepare(state_dict, root, name, comm, **options)
        return self._launch(job, tensors, comm.rank)

    def _comm(self) -> Comm:
        """The checkpointer's private group (made collectively on first use)."""
        if not self._group_ready:
            self._group = private_group(self._process_group)
            self._group_ready = True
        return Comm(self._group)

    def _launch(self, job: Any, tensors: Mapping[str, torch.Tensor], rank: int) -> AsyncSaveHandle:
        """Copy this rank's part to host buffers now; write and commit ``job`` in the background."""
        try:
            job.sources = self._stage(job.plan.writes[rank], tensors)
        except Exception as err:  # noqa: BLE001 - reported collectively by run()
            job.error = f"cannot copy the tensors to save: {err}"
        handle = AsyncSaveHandle(job.name, self._pool.submit(job.run))
        with self._lock:
            self._pending = handle
        return handle

    def wait(self) -> Optional[str]:
        """Wait for the save in flight; returns its name (None if none) or raises its error."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            return pending.result()
        except CheckpointError as err:
            raise CheckpointError(f"the background save of {pending.name!r} failed: {err}") from None

    def close(self) -> None:
        """Wait for the save in flight and stop the background thread (raises its error)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            self._buffers.clear()

    def _atexit(self) -> None:
        try:
            self.close()
        except CheckpointError as err:
            log.error("%s", err)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_DEFAULT: Dict[Tuple[int, int], AsyncCheckpointer] = {}


def async_save(
    state_dict: Mapping[str, Any],
    root: str,
    name: Optional[str] = None,
    *,
    process_group: Any = None,
    **kwargs: Any,
) -> AsyncSaveHandle:
    """``save`` in the background via a per-process-group default :class:`AsyncCheckpointer`.

    Returns once the state is copied to host memory. The next ``async_save`` (or process
    exit) waits for this one; its error, if any, is raised there or by ``handle.result()``.
    """
    import torch.distributed as dist

    key = (id(process_group), id(dist.group.WORLD) if dist.is_available() and dist.is_initialized() else 0)
    ckpt = _DEFAULT.get(key)
    if ckpt is None or ckpt._closed:
        ckpt = _DEFAULT[key] = AsyncCheckpointer(process_group)
    return ckpt.save(state_dict, root, name, **kwargs)


def wait_async_saves() -> None:
    """Wait for every default background save (e.g. before the training script exits)."""
    for ckpt in list(_DEFAULT.values()):
        ckpt.wait()
