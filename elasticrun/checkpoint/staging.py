"""Moving checkpoint bytes between device memory and files through reusable host buffers.

Both directions use two staging buffers per thread — pinned (page-locked) on CUDA, taken
from a process-wide pool because pinning is slow — and copies queued ``non_blocking`` on a
side stream, so the transfer of one chunk overlaps the file I/O (and hashing) of the other:

* :class:`DeviceStager` (loads): file bytes -> buffer (``pread``) -> device tensor.
* :func:`host_pieces` (saves): device tensor -> buffer -> the writer, which hashes and writes it.

Without CUDA the same rotation runs with plain memory and synchronous copies (what the tests
exercise on CPU-only machines).
"""

from __future__ import annotations

import os
import threading
from contextlib import nullcontext as _nothing
from typing import IO, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from elasticrun.errors import CheckpointError

#: Bytes per staged copy; two such buffers per thread.
STAGE_BYTES = 32 << 20

_POOL_LOCK = threading.Lock()
_PINNED: List[torch.Tensor] = []  # reusable pinned staging buffers (pinning is slow: allocate once)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def readinto_exact(f: IO[bytes], offset: int, view: memoryview, where: str) -> None:
    """Fill ``view`` with the bytes at ``offset`` of ``f``; a short file is a CheckpointError."""
    if len(view) == 0:
        return
    fileno = fileno_of(f)
    got = 0
    if fileno is not None:
        while got < len(view):
            n = os.preadv(fileno, [view[got:]], offset + got)
            if n <= 0:
                break
            got += n
    else:
        f.seek(offset)
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    if got != len(view):
        raise CheckpointError(f"{where} is truncated: wanted {len(view)} bytes at offset {offset}, got {got}")


def fileno_of(f: IO[bytes]) -> Optional[int]:
    """The descriptor to ``preadv`` from, or None where the file (or the OS) has none."""
    try:
        return f.fileno() if hasattr(os, "preadv") else None
    except (OSError, AttributeError, ValueError, NotImplementedError):
        return None


def _take_buffers(n: int, pinned: bool, size: int = STAGE_BYTES) -> List[torch.Tensor]:
    """``n`` staging buffers of at least ``size`` bytes (pinned ones from the pool when there are)."""
    if not pinned:
        return [torch.empty(size, dtype=torch.uint8) for _ in range(n)]
    with _POOL_LOCK:
        out = [_PINNED.pop() for _ in range(min(n, len(_PINNED)))]
    while len(out) < n:
        out.append(torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True))
    return out


def _give_back(bufs: List[torch.Tensor], pinned: bool) -> None:
    if pinned:
        with _POOL_LOCK:
            _PINNED.extend(bufs)


class DeviceStager:
    """Copies file byte ranges into a device tensor's bytes through two host buffers.

    On CUDA the buffers are pinned and each copy is ``non_blocking`` on a side stream: the
    read of chunk i+1 overlaps the copy of chunk i, and a buffer is refilled only after its
    previous copy finished (an event). Elsewhere (a CPU "device", used by the tests) the same
    rotation runs with plain memory and synchronous copies. Call :meth:`finish` at the end.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.stream is not None:  # the targets may still be written by queued kernels
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self.bufs = _take_buffers(2, self.cuda)
        self.events: List[Optional[torch.cuda.Event]] = [None, None]
        self.turn = 0

    def copy(self, f: object, offset: int, dst: torch.Tensor, where: str) -> None:
        """Fill ``dst`` (a contiguous uint8 tensor on the device) with the bytes at ``offset`` of ``f``."""
        done, total = 0, dst.numel()
        while done < total:
            k = self.turn % 2
            self.turn += 1
            ev = self.events[k]
            if ev is not None:
                ev.synchronize()  # this buffer's previous copy has left it
            n = min(STAGE_BYTES, total - done)
            buf = self.bufs[k][:n]
            readinto_exact(f, offset + done, memoryview(buf.numpy()), where)  # type: ignore[arg-type]
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    dst[done:done + n].copy_(buf, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                self.events[k] = ev
            else:
                dst[done:done + n].copy_(buf)
            done += n

    def copy_many(self, f: object, ranges: Sequence[Tuple[int, torch.Tensor]], where: str) -> None:
        """Fill each ``(offset, dst)`` like :meth:`copy`; neighbouring small ranges (adjacent in the
        file) share one read into a buffer and one event, instead of a read and a sync each."""
        group: List[Tuple[int, torch.Tensor]] = []

        def flush() -> None:
            if not group:
                return
            start, end = group[0][0], group[-1][0] + group[-1][1].numel()
            k = self.turn % 2
            self.turn += 1
            ev = self.events[k]
            if ev is not None:
                ev.synchronize()
            buf = self.bufs[k][:end - start]
            readinto_exact(f, start, memoryview(buf.numpy()), where)  # type: ignore[arg-type]
            with torch.cuda.stream(self.stream) if self.stream is not None else _nothing():
                for off, dst in group:
                    dst.copy_(buf[off - start:off - start + dst.numel()], non_blocking=self.stream is not None)
                if self.stream is not None:
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    self.events[k] = ev
            group.clear()

        for off, dst in sorted(ranges, key=lambda r: r[0]):
            if dst.numel() > STAGE_BYTES // 4:  # large: streamed on its own, chunk by chunk
                flush()
                self.copy(f, off, dst, where)
                continue
            if group and (off != group[-1][0] + group[-1][1].numel() or off + dst.numel() - group[0][0] > STAGE_BYTES):
                flush()
            group.append((off, dst))
        flush()

    def finish(self) -> None:
        """Wait for the last copies and return the buffers for reuse."""
        if self.stream is not None:
            self.stream.synchronize()
        _give_back(self.bufs, self.cuda)
        self.bufs = []


def host_pieces(tensors: Sequence[torch.Tensor], before_reuse: Callable[[int], None],
                piece: int = STAGE_BYTES, stage_cpu: bool = False) -> Iterator[memoryview]:
    """The bytes of contiguous tensors, in order, as host memoryviews of at most ``piece`` bytes.

    CPU tensors are viewed without copying. Device tensors are copied into two reusable
    (pinned, on CUDA) buffers on a side stream, small ones packed together into one buffer,
    pipelined: buffer i+1's copies run while the caller consumes buffer i. A staged view is valid until the
    generator advances twice; ``before_reuse(j)`` is called before the buffer of view ``j``
    (counting from 0) is refilled, and with the last index at the end, so a caller that
    consumes views asynchronously (hashing on a helper thread) can wait for them first.
    ``stage_cpu`` stages CPU tensors too (the tests' way to run the rotation without a GPU).
    """
    staged = [t.device.type != "cpu" or stage_cpu for t in tensors]
    step = min(piece, STAGE_BYTES)
    units = piece_units([t.numel() * t.element_size() for t in tensors], staged, piece, step)
    devices = {t.device for t, s in zip(tensors, staged) if s}
    if not devices:
        for k, a, n, _ in units:
            yield byte_view(tensors[k])[a:a + n]
        return
    yield from _staged_pieces(tensors, units, devices, before_reuse, step)


#: ``(tensor, start, length, offset in the buffer)``: one tensor's bytes copied into a staging buffer.
Segment = Tuple[int, int, int, int]
#: A view of a CPU tensor ``(k, start, length, None)``, or one staging buffer's worth of
#: device bytes, small tensors packed together: ``(-1, 0, length, segments)``.
Unit = Tuple[int, int, int, Optional[List[Segment]]]


def piece_units(sizes: Sequence[int], staged: Sequence[bool], piece: int, step: int) -> List[Unit]:
    """The units :func:`host_pieces` yields, in byte order, for tensors of ``sizes`` bytes:
    unstaged tensors cut into views of at most ``piece`` bytes, staged ones packed into
    buffers of ``step`` bytes (a tensor may span buffers; a buffer may hold several tensors)."""
    units: List[Unit] = []
    group: List[Segment] = []
    filled = 0

    def close_group() -> None:
        nonlocal group, filled
        if group:
            units.append((-1, 0, filled, group))
        group, filled = [], 0

    for k, n in enumerate(sizes):
        if not staged[k]:
            close_group()
            units += [(k, a, min(piece, n - a), None) for a in range(0, n, piece)]
            continue
        a = 0
        while a < n:
            take = min(step - filled, n - a)
            group.append((k, a, take, filled))
            filled += take
            a += take
            if filled == step:
                close_group()
    close_group()
    return units


def _staged_pieces(tensors: Sequence[torch.Tensor], units: List[Unit], devices: set,
                   before_reuse: Callable[[int], None], step: int) -> Iterator[memoryview]:
    """Yield ``units`` through two rotating staging buffers (see :func:`host_pieces`)."""
    flats = [t.detach().reshape(-1).view(torch.uint8) if t.numel() else t for t in tensors]
    cuda = any(d.type == "cuda" for d in devices)
    streams = {d: torch.cuda.Stream(d) for d in devices if d.type == "cuda"}
    for d, stream in streams.items():
        stream.wait_stream(torch.cuda.current_stream(d))  # the copies see the finished step
    bufs = _take_buffers(2, cuda, step)
    events: List[List[torch.cuda.Event]] = [[], []]

    def issue(i: int) -> None:
        segments = units[i][3]
        if segments is None:
            return
        buf, events[i % 2] = bufs[i % 2], []
        for k, a, n, off in segments:
            src = flats[k][a:a + n]
            stream = streams.get(src.device)
            if stream is None:
                buf[off:off + n].copy_(src)
                continue
            with torch.cuda.stream(stream):
                buf[off:off + n].copy_(src, non_blocking=True)
        for stream in streams.values():  # one event per device and buffer, after its copies
            ev = torch.cuda.Event()
            ev.record(stream)
            events[i % 2].append(ev)

    try:
        if units:
            issue(0)
        for i, (k, a, n, segments) in enumerate(units):
            if i + 1 < len(units):
                if i:
                    before_reuse(i - 1)  # unit i+1 takes the buffer of unit i-1
                issue(i + 1)
            if segments is None:
                yield byte_view(tensors[k])[a:a + n]
                continue
            for ev in events[i % 2]:
                ev.synchronize()
            yield memoryview(bufs[i % 2][:n].numpy())
    finally:
        for stream in streams.values():
            stream.synchronize()
        if units:
            before_reuse(len(units) - 1)
        _give_back(bufs, cuda)
