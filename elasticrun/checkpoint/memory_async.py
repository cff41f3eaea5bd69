"""Async snapshots: the only stall is the copy into host buffers reused across snapshots.

CPU tensors are copied into plain buffers; CUDA tensors into pinned buffers, on a side
stream that first waits for the training stream (so the copy sees the finished step),
and the call returns once that copy is done. Writing, hashing and the commit run in the
background (:class:`~elasticrun.checkpoint.background.AsyncCheckpointer`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from elasticrun.checkpoint.background import AsyncCheckpointer


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


__all__ = ["PinnedAsyncCheckpointer"]
