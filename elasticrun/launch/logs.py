"""Worker output: prefix each line with ``[node/rank]`` on the console, copy to per-rank files.

Layout with ``--log-dir D``: ``D/<run-id>/attempt_<round>/rank_<rank>/{stdout,stderr}.log``
plus the worker's ``error.json``. ``--redirects`` keeps a stream off the console (files only);
``--tee`` and ``--log-dir`` write files while the console still shows the stream.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import IO, BinaryIO, Dict, List, Optional

_console_lock = threading.Lock()

STREAMS = {1: "stdout", 2: "stderr"}


def stream_selected(spec: Dict[int, str], local_rank: int, stream: int) -> bool:
    """Does a ``--redirects``/``--tee`` map select ``stream`` (1 or 2) of ``local_rank``?"""
    value = spec.get(local_rank, spec.get(-1, "0"))
    return value == "3" or value == str(stream)


class LinePump:
    """Copy one pipe to the console (prefixed) and/or a file, line by line, in a thread."""

    def __init__(
        self,
        pipe: BinaryIO,
        prefix: str,
        console: Optional[BinaryIO],
        file_path: Optional[str],
    ) -> None:
        self._pipe = pipe
        self._prefix = prefix.encode()
        self._console = console
        self._file: Optional[IO[bytes]] = None
        if file_path:
            os.makedirs(os.path.dirname(file_path), exist_ok=True)
            self._file = open(file_path, "ab")
        self._thread = threading.Thread(target=self._run, name=f"log{prefix}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for line in iter(self._pipe.readline, b""):
                if self._console is not None:
                    with _console_lock:
                        tail = b"" if line.endswith(b"\n") else b"\n"
                        self._console.write(self._prefix + line + tail)
                        self._console.flush()
                if self._file is not None:
                    self._file.write(line)
                    self._file.flush()
        except (OSError, ValueError):
            pass
        finally:
            try:
                self._pipe.close()
            except OSError:
                pass
            if self._file is not None:
                self._file.close()

    def join(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)


def console_stream(stream: int) -> BinaryIO:
    return sys.stdout.buffer if stream == 1 else sys.stderr.buffer


def attempt_dir(log_dir: str, run_id: str, round_: int, rank: int) -> str:
    return os.path.join(log_dir, run_id, f"attempt_{round_}", f"rank_{rank}")


def join_all(pumps: List[LinePump], timeout: float = 5.0) -> None:
    for p in pumps:
        p.join(timeout)
