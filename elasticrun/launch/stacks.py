"""Reading the Python stacks a hung worker dumped (:mod:`faulthandler`, all threads).

Pure functions over the bytes of a worker's stderr tail: :func:`last_dump` finds the newest
dump, :func:`collective_waited_in` tells whether its main thread waits in a
``torch.distributed`` collective, and :func:`user_view` renders the dump without the frames
that are elasticrun's own (the bootstrap that runs the script: ``warm.py``, ``zygote.py``,
``runpy``) and without elasticrun's own threads, so a failure summary shows the script's frames.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Optional

#: faulthandler's mark at the end of each thread's header line.
THREAD_MARK = b"(most recent call first):"
_HEAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(?P<path>.*)", line (?P<line>\d+) in (?P<name>.*)$')
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../elasticrun
#: Collectives named in ``torch.distributed``'s own module, the innermost of which is reported.
_C10D_FILE = "distributed_c10d.py"
_THREADING_FILES = ("threading.py", "concurrent/futures/thread.py")


@dataclass(frozen=True)
class Frame:
    """One line of a dumped stack."""

    path: str
    line: int
    name: str
    text: str  # the line as faulthandler wrote it (other lines, such as "<no Python frame>", keep only this)


@dataclass
class ThreadStack:
    """One thread of a dump, innermost frame first."""

    header: str
    frames: List[Frame]

    @property
    def is_main(self) -> bool:
        """The thread running the script's top level (a ``<module>`` frame), not one it started."""
        return any(f.name == "<module>" for f in self.frames) and not self.started_by_threading

    @property
    def started_by_threading(self) -> bool:
        return bool(self.frames) and self.frames[-1].path.endswith(_THREADING_FILES)


def last_dump(tail: bytes) -> List[ThreadStack]:
    """The threads of the newest faulthandler dump in ``tail`` (empty when it holds none)."""
    lines = tail.decode("utf-8", "replace").replace("\r\n", "\n").split("\n")
    heads = [i for i, ln in enumerate(lines) if _HEAD.match(ln.strip())]
    if not heads:
        return []
    # A dump is a run of thread blocks (frame lines, a blank line between two): go back from the
    # newest header while only frame lines come between, and no thread appears twice (an older dump).
    first = heads[-1]
    seen = {_HEAD.match(lines[first].strip()).group(2)}  # type: ignore[union-attr]
    for i in reversed(heads[:-1]):
        ident = _HEAD.match(lines[i].strip()).group(2)  # type: ignore[union-attr]
        if ident in seen or not all(_is_frame_line(ln) for ln in lines[i + 1:first]):
            break
        seen.add(ident)
        first = i
    threads: List[ThreadStack] = []
    for ln in lines[first:]:
        stripped = ln.strip()
        if _HEAD.match(stripped):
            threads.append(ThreadStack(stripped, []))
        elif threads and _is_frame_line(ln) and stripped:
            m = _FRAME.match(ln)
            threads[-1].frames.append(Frame(m.group("path"), int(m.group("line")), m.group("name"), stripped) if m
                                      else Frame("", 0, "", stripped))
        elif threads and not stripped and threads[-1].frames:
            continue  # the blank line between two threads
        elif threads:
            break  # the worker wrote something else after the dump
    return threads


def _is_frame_line(line: str) -> bool:
    return not line.strip() or line.startswith("  ")


def main_thread(threads: List[ThreadStack]) -> Optional[ThreadStack]:
    """The script's main thread in a dump (the current thread if none has a ``<module>`` frame)."""
    for t in threads:
        if t.is_main:
            return t
    return next((t for t in threads if t.header.startswith("Current thread")), None)


def _in_torch_distributed(path: str) -> bool:
    return "/torch/distributed/" in path.replace(os.sep, "/")


def collective_waited_in(threads: List[ThreadStack]) -> Optional[str]:
    """The ``torch.distributed`` call the main thread is blocked in (``all_reduce``, ``barrier``, …),
    or None when it stands anywhere else (or the dump has no main thread)."""
    main = main_thread(threads)
    if main is None or not main.frames or not _in_torch_distributed(main.frames[0].path):
        return None
    inner = []
    for f in main.frames:
        if not _in_torch_distributed(f.path):
            break
        inner.append(f)
    named = [f.name for f in inner if f.path.endswith(_C10D_FILE)]
    return named[0] if named else inner[-1].name


def is_own_frame(frame: Frame) -> bool:
    """A frame of elasticrun's own code or of ``runpy`` (how the script was started)."""
    path = frame.path
    return (path.startswith(_PACKAGE_DIR + os.sep) or path == "<frozen runpy>"
            or os.path.basename(path) == "runpy.py")


def is_own_frame_line(line: str) -> bool:
    """Whether one line of a dump is a frame of elasticrun's own code or of ``runpy``."""
    m = _FRAME.match(line)
    return m is not None and is_own_frame(Frame(m.group("path"), int(m.group("line")), m.group("name"), ""))


def is_dump_header(line: str) -> bool:
    """Whether ``line`` starts one thread's stack in a faulthandler dump."""
    return _HEAD.match(line.strip()) is not None


def user_view(threads: List[ThreadStack]) -> str:
    """The dump as text, main thread first, without elasticrun's and runpy's frames and without the
    threads that then have nothing of the script's (elasticrun's reporters, idle pool threads)."""
    ordered = sorted(threads, key=lambda t: not t.is_main)
    blocks = []
    for t in ordered:
        frames = [f for f in t.frames if not is_own_frame(f)]
        if not t.is_main and all(f.path.endswith(_THREADING_FILES) for f in frames):
            continue
        blocks.append("\n".join([t.header] + [f"  {f.text}" for f in frames]))
    return "\n\n".join(blocks)


__all__ = ["THREAD_MARK", "Frame", "ThreadStack", "collective_waited_in", "is_dump_header", "is_own_frame",
           "is_own_frame_line", "last_dump", "main_thread", "user_view"]
