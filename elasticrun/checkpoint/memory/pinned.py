"""Async snapshots: the only stall is the copy into host buffers reused across snapshots.

CPU tensors are copied into plain buffers; CUDA tensors into pinned buffers, on a side
stream that first waits for the training stream (so the copy sees the finished step),
and the call returns once that copy is done. Writing, hashing and the per-node commit
(:class:`~elasticrun.checkpoint.memory.commit.NodeSaveJob`) run in the background
(:class:`~elasticrun.checkpoint.background.AsyncCheckpointer`).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from elasticrun.checkpoint.background import AsyncCheckpointer, AsyncSaveHandle
from elasticrun.checkpoint.format import Placement
from elasticrun.checkpoint.memory.commit import NodeLayout, to_node_job
from elasticrun.checkpoint.writer import prepare
from elasticrun.errors import CheckpointError


class PinnedAsyncCheckpointer(AsyncCheckpointer):
    """An AsyncCheckpointer whose device-to-host copies use pinned buffers and a side stream."""

    def __init__(self, process_group: Any = None) -> None:
        super().__init__(process_group)
        self._stream: Optional[Any] = None

    def _snapshot(self, key: str, src: torch.Tensor) -> torch.Tensor:
        if src.device.type != "cuda":
            return super()._snapshot(key, src)
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != src.dtype or buf.shape != src.shape or not buf.is_pinned():
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            self._buffers[key] = buf
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=src.device)
        self._stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self._stream):
            buf.copy_(src.detach(), non_blocking=True)
        self._stream.synchronize()  # the bytes must be in host memory before the background write
        return buf

    def save(self, state_dict: Mapping[str, Any], root: str, name: Optional[str] = None, *,  # type: ignore[override]
             training_state: Any = None, placements: Optional[Mapping[str, Placement]] = None,
             keep_last: Optional[int] = None, layout: Optional[NodeLayout] = None,
             **_unused: Any) -> AsyncSaveHandle:
        """Copy the state to host buffers, then write and commit it per node in the background
        (``layout``: which ranks share a snapshot directory; default: all of them)."""
        if self._closed:
            raise CheckpointError("this checkpointer is closed: create a new one")
        self.wait()
        comm = self._comm()
        job, tensors = prepare(state_dict, root, name, comm, training_state=training_state, placements=placements,
                               keep_last=keep_last)
        node_job = to_node_job(job, layout or NodeLayout([list(range(comm.world_size))], comm.rank))
        return self._launch(node_job, tensors, comm.rank)


__all__ = ["PinnedAsyncCheckpointer"]
