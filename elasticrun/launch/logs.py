"""Worker output: pass each worker's stdout/stderr through live, optionally copied to files.

Output is copied as the bytes arrive (not line by line), so a ``\\r``-updated progress bar
(tqdm) shows as it updates. Each console line, an empty one too, starts with a prefix,
``[node/rank]:`` by default; torchrun's ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` (``${role_name}``,
``${local_rank}``, ``${rank}``, and here also ``${node}``) replaces it, and an empty
template turns prefixes off. A ``\\r`` starts a line too, so a redrawn bar keeps its prefix.
The Python stacks a hung worker dumps (``--hang-timeout``) reach the console without
elasticrun's own frames (:class:`DumpFilter`); files keep every byte.
A line is shown whole: an unfinished line waits for its end, and only a pause inside it
(:data:`FLUSH_PAUSE_S`, e.g. a bar without a newline) shows its start early. When another
worker's text interrupts it meanwhile, its continuation starts a new line with the prefix again.

With ``--log-dir D`` (torchrun's layout) every worker's streams are also written to
``D/<run-id>_<random>/attempt_<round>/<local_rank>/{stdout,stderr}.log`` next to its
``error.json``, raw (no prefix). ``--redirects`` keeps a stream off the console (files
only), ``--tee`` copies it to files as well, and ``--local-ranks-filter`` keeps the other
local ranks off the console (their files are still written).
"""

from __future__ import annotations

import enum
import os
import re
import select
import sys
import tempfile
import threading
from string import Template
from typing import IO, BinaryIO, Dict, List, Optional, Protocol, Sequence, Set, Tuple

from elasticrun.job import env as names
from elasticrun.launch.config import Std
from elasticrun.launch.stacks import THREAD_MARK, is_dump_header, is_own_frame_line

STREAMS = {1: "stdout", 2: "stderr"}
DEFAULT_PREFIX = "[${node}/${rank}]:"
TAIL_KEEP = 16 * 1024  # bytes of a worker's stderr kept for the failure summary
_CHUNK = 64 * 1024
FLUSH_PAUSE_S = 0.1  # how long an unfinished line waits for its end before its start is shown
_PIECES = re.compile(rb"[^\r\n]+|\r\n|\r|\n")


def stream_selected(spec: Dict[int, Std], local_rank: int, stream: int) -> bool:
    """Does a ``--redirects``/``--tee`` map select ``stream`` (1 or 2) of ``local_rank``?"""
    return spec.get(local_rank, spec.get(-1, Std.NONE)).selects(stream)


def on_console(local_rank: int, ranks_filter: Optional[Sequence[int]]) -> bool:
    """``--local-ranks-filter``: does ``local_rank``'s output go to the console (None: every rank)?"""
    return not ranks_filter or local_rank in ranks_filter


def line_prefix(node: str, rank: int, local_rank: int, role: str, environ: Optional[Dict[str, str]] = None) -> str:
    """The console prefix of one worker (see the module docstring)."""
    env = os.environ if environ is None else environ
    template = env.get(names.LOG_LINE_PREFIX_TEMPLATE, DEFAULT_PREFIX)
    values = {"node": node, "rank": str(rank), "local_rank": str(local_rank), "role_name": role}
    return Template(template).safe_substitute(values)


class LineState(enum.IntEnum):
    """Where a worker's output stands between two chunks (for :func:`add_prefix`)."""

    MID = 0  # inside a line
    START = 1  # at the start of a line: the stream's start or after ``\n``
    AFTER_CR = 2  # after ``\r``: a redraw starts here, or ``\n`` completes a ``\r\n``


def add_prefix(data: bytes, prefix: bytes, state: LineState) -> Tuple[bytes, LineState]:
    """``data`` with ``prefix`` before every line's first byte (after ``\n`` or ``\r``), empty
    lines included (as torchrun does): a ``\n`` at a line's start gets the prefix too, unless it
    completes a ``\r\n``.

    ``state`` carries over from the previous chunk; returns (output, state).
    """
    if not prefix:
        return data, (LineState.START if data.endswith(b"\n") else LineState.AFTER_CR if data.endswith(b"\r")
                      else LineState.MID) if data else state
    out = bytearray()
    for m in _PIECES.finditer(data):
        piece = m.group()
        if piece[0] in (10, 13):  # \n, \r or \r\n
            if state is LineState.START and piece != b"\r":
                out += prefix  # an empty line
            out += piece
            state = LineState.AFTER_CR if piece == b"\r" else LineState.START
        else:
            if state is not LineState.MID:
                out += prefix
            out += piece
            state = LineState.MID
    return bytes(out), state


def split_line_end(data: bytes) -> Tuple[bytes, bytes]:
    """``data`` cut after its last ``\\n`` or ``\\r``: (finished lines, the unfinished rest)."""
    end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
    return data[:end], data[end:]


class DumpFilter:
    """Leaves elasticrun's own frames (the bootstrap that runs the script, ``runpy``) out of the
    Python stack dumps a hung worker writes (``--hang-timeout``) on their way to the console, so
    they show the script's frames. Everything else passes untouched; files keep every byte."""

    def __init__(self) -> None:
        self.in_dump = False
        self.mid_line = False  # the last chunk ended inside a line (shown early, after a pause)

    def __call__(self, data: bytes) -> bytes:
        if not data:
            return data  # nothing read yet beyond an unfinished line: says nothing about where lines end
        if not self.in_dump and THREAD_MARK not in data:
            self.mid_line = not data.endswith((b"\n", b"\r"))
            return data
        out = []
        for i, line in enumerate(data.splitlines(keepends=True)):
            text = line.rstrip(b"\r\n").decode("utf-8", "replace")
            if i == 0 and self.mid_line:
                pass  # the end of a line shown in part already: passes as it is
            elif is_dump_header(text):
                self.in_dump = True
            elif self.in_dump and text.startswith("  "):
                if is_own_frame_line(text):
                    continue
            elif self.in_dump and text.strip():
                self.in_dump = False  # the worker writes something else: the dump is over
            out.append(line)
        self.mid_line = not data.endswith((b"\n", b"\r"))
        return b"".join(out)

    def holds(self, unfinished: bytes) -> bool:
        """Whether an unfinished line must wait for its end even through a pause: inside a dump, the start
        of a frame line (indented), which can be left out only once its path is whole. A dump written by a
        worker the host deschedules mid-line would otherwise show an elasticrun frame's first half."""
        return self.in_dump and unfinished.startswith(b"  "[:len(unfinished)])


class Console:
    """One console stream (stdout or stderr) shared by every worker's pump.

    Writes of one chunk are atomic. When a worker writes while another one's line is still
    open (no newline yet), a newline goes first, so two workers' text never share a line; the
    interrupted worker's continuation then starts with its prefix again.
    """

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream
        self._lock = threading.Lock()
        self._open_by: Optional[object] = None  # the pump whose line is unfinished
        self._broken: Set[object] = set()  # pumps whose unfinished line another one ended

    def write(self, owner: object, data: bytes, ends_line: bool, continues: bool = False,
              prefix: bytes = b"") -> None:
        """Write ``data`` for ``owner``; ``ends_line``: it ends with a newline; ``continues``: it
        continues ``owner``'s unfinished line (``prefix`` goes first if another worker ended it)."""
        with self._lock:
            broke = self._open_by is not None and self._open_by is not owner
            if broke:
                self._broken.add(self._open_by)
            if owner in self._broken:
                self._broken.discard(owner)
                if continues:  # its line was already ended for it: start a prefixed one
                    data = data[1:] if data.startswith(b"\n") else prefix + data
            if broke and data:
                data = b"\n" + data
            if not data:
                return
            self._open_by = None if ends_line else owner
            try:
                self.stream.write(data)
                self.stream.flush()
            except (OSError, ValueError):
                pass


_CONSOLES: Dict[int, Console] = {}
_consoles_lock = threading.Lock()


def console_for(stream: int) -> Console:
    """The process-wide :class:`Console` for stream 1 (stdout) or 2 (stderr)."""
    with _consoles_lock:
        if stream not in _CONSOLES:
            _CONSOLES[stream] = Console(sys.stdout.buffer if stream == 1 else sys.stderr.buffer)
        return _CONSOLES[stream]


class Tap(Protocol):
    """A third copy of a worker's stream (the bytes as they arrive, then the end), e.g. filtered lines."""

    def feed(self, data: bytes) -> None: ...

    def finish(self) -> None: ...


class OutputPump:
    """Copy one pipe to the console (prefixed) and/or a file as bytes arrive, in a thread (and to ``tap``)."""

    def __init__(
        self,
        pipe: BinaryIO,
        prefix: str,
        console: Optional[Console],
        file_path: Optional[str],
        keep_tail: int = 0,
        tap: Optional[Tap] = None,
    ) -> None:
        self._pipe = pipe
        self._tap = tap
        self._prefix = prefix.encode()
        self._console = console
        self._file: Optional[IO[bytes]] = None
        self._keep = keep_tail
        self._tail = bytearray()
        self._tail_lock = threading.Lock()
        self._dumps = DumpFilter()
        if file_path:
            os.makedirs(os.path.dirname(file_path), exist_ok=True)
            self._file = open(file_path, "ab")
        self._thread = threading.Thread(target=self._run, name=f"log{prefix}", daemon=True)
        self._thread.start()

    def _show(self, data: bytes) -> None:
        """Prefix ``data`` and write it to the console (whole lines, or a line's start after a pause)."""
        if self._console is not None:
            data = self._dumps(data)
        if not data or self._console is None:
            return
        continues = self._at is LineState.MID
        out, self._at = add_prefix(data, self._prefix, self._at)
        self._line_open = not out.endswith(b"\n")
        self._console.write(self, out, not self._line_open, continues, self._prefix)

    def _run(self) -> None:
        self._at = LineState.START
        self._line_open = False  # the console line we last wrote has no newline yet
        pending = b""  # an unfinished line, held back until its end or a pause
        try:
            fd = self._pipe.fileno()
            while True:
                if pending and not self._dumps.holds(pending) and not select.select([fd], [], [], FLUSH_PAUSE_S)[0]:
                    self._show(pending)  # a pause inside a line: show what came so far
                    pending = b""
                data = os.read(fd, _CHUNK)
                if not data:
                    break
                if self._console is not None:
                    whole, pending = split_line_end(pending + data)
                    if len(pending) >= _CHUNK:  # a very long line: show it in pieces
                        whole, pending = whole + pending, b""
                    self._show(whole)
                if self._file is not None:
                    self._file.write(data)
                    self._file.flush()
                if self._tap is not None:
                    self._tap.feed(data)
                if self._keep:
                    with self._tail_lock:
                        self._tail += data
                        del self._tail[: max(0, len(self._tail) - self._keep)]
        except (OSError, ValueError):
            pass
        finally:
            self._show(pending)
            if self._console is not None and self._line_open:
                self._console.write(self, b"\n", True, True)  # end the worker's last line
            try:
                self._pipe.close()
            except OSError:
                pass
            if self._file is not None:
                self._file.close()
            if self._tap is not None:
                self._tap.finish()

    def tail(self) -> bytes:
        """The last bytes read (up to ``keep_tail``)."""
        with self._tail_lock:
            return bytes(self._tail)

    def join(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()


def run_log_dir(log_dir: str, run_id: str) -> str:
    """``<log_dir>/<run_id>_<random>``: this agent's directory under ``--log-dir`` (torchrun's layout)."""
    os.makedirs(log_dir, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{run_id}_", dir=log_dir)


def worker_log_dir(run_dir: str, round_: int, local_rank: int) -> str:
    """``<run_dir>/attempt_<round>/<local_rank>``: one worker's files for one round."""
    return os.path.join(run_dir, f"attempt_{round_}", str(local_rank))


def join_all(pumps: List[OutputPump], timeout: float = 5.0) -> None:
    for p in pumps:
        p.join(timeout)
