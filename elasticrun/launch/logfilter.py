"""``--duplicate-stdout-filters`` / ``--duplicate-stderr-filters``: matching lines copied into one file per attempt.

As torchrun (``PContext`` with ``DefaultLogsSpecs``) does: every line of a tee'd stream
(``--tee``) that contains one of the filter strings is appended to
``<log dir>/<run id>_<random>/attempt_<round>/filtered_stdout.log`` (``filtered_stderr.log``), the
node's workers into one file, each line after its worker's prefix; local ranks that
``--local-ranks-filter`` keeps off the console are not copied, and streams that are not tee'd
are not either. The file is created, empty, when the attempt's workers start, even when no
stream feeds it. The prefix is the console's (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` when
set, as in torchrun). Lines end at ``\\n``, ``\\r\\n`` or ``\\r`` (a tqdm bar's redraws are lines,
as Python's text mode reads them in torchrun); a filter matches anywhere in the line, newline
included, so an empty filter matches every line.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Dict, List, Optional, Sequence

from elasticrun.launch.config import LaunchConfig
from elasticrun.launch.logs import STREAMS, on_console, stream_selected

FILTERED_NAMES = {1: "filtered_stdout.log", 2: "filtered_stderr.log"}
_LINE_END = re.compile(rb"\r\n|\r|\n")


def stream_filters(cfg: LaunchConfig) -> Dict[int, List[str]]:
    """Stream (1 stdout, 2 stderr) → its filter strings, for the streams that have some."""
    filters = {1: cfg.logs.duplicate_stdout_filters, 2: cfg.logs.duplicate_stderr_filters}
    return {stream: list(needles) for stream, needles in filters.items() if needles}


def copied(cfg: LaunchConfig, local_rank: int, stream: int) -> bool:
    """Whether ``local_rank``'s ``stream`` feeds the attempt's filtered file (it is tee'd and shown)."""
    _, tee = cfg.std_streams()
    return (stream in stream_filters(cfg) and stream_selected(tee, local_rank, stream)
            and on_console(local_rank, cfg.logs.local_ranks_filter))


def unfed_warnings(cfg: LaunchConfig) -> List[str]:
    """One line per filtered stream that no local worker feeds (as in torchrun, its file stays empty)."""
    lines = []
    for stream in stream_filters(cfg):
        if not any(copied(cfg, rank, stream) for rank in range(cfg.workers.nproc_per_node)):
            name = STREAMS[stream]
            lines.append(f"--duplicate-{name}-filters: no local rank's {name} is tee'd (--tee {stream} or 3) and "
                         f"shown, so {FILTERED_NAMES[stream]} stays empty (as under torchrun)")
    return lines


class FilteredCopy:
    """One attempt's filtered file for one stream; the node's workers write whole lines into it."""

    def __init__(self, path: str, needles: Sequence[str]) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path
        self.needles = list(needles)
        self._lock = threading.Lock()
        self._file = open(path, "w", encoding="utf-8", errors="replace")  # noqa: SIM115 - closed by close()

    def feeder(self, prefix: str) -> LineFeeder:
        """A feeder for one worker's stream, its lines written after ``prefix``."""
        return LineFeeder(self, prefix)

    def write(self, prefix: str, line: str) -> None:
        """Append ``prefix + line`` when ``line`` (newline included) contains a filter string."""
        if not any(needle in line for needle in self.needles):
            return
        with self._lock:
            if not self._file.closed:
                self._file.write(prefix + line)
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class LineFeeder:
    """Cuts one worker's output bytes into lines for a :class:`FilteredCopy` (an unfinished line waits)."""

    def __init__(self, copy: FilteredCopy, prefix: str) -> None:
        self._copy = copy
        self._prefix = prefix
        self._pending = b""

    def feed(self, data: bytes) -> None:
        data = self._pending + data
        start = 0
        for end in _LINE_END.finditer(data):
            if end.group() == b"\r" and end.end() == len(data):
                break  # maybe the first half of a \r\n: wait for the next bytes
            self._line(data[start:end.start()])
            start = end.end()
        self._pending = data[start:]

    def finish(self) -> None:
        """The stream ended: its last line, even without a newline."""
        pending, self._pending = self._pending, b""
        if pending:
            self._line(pending[:-1] if pending.endswith(b"\r") else pending)

    def _line(self, raw: bytes) -> None:
        self._copy.write(self._prefix, raw.decode("utf-8", "replace") + "\n")


def open_filtered(cfg: LaunchConfig, attempt_dir: str) -> Dict[int, FilteredCopy]:
    """The attempt's filtered files (created empty), by stream, for the streams with filters."""
    return {stream: FilteredCopy(os.path.join(attempt_dir, FILTERED_NAMES[stream]), needles)
            for stream, needles in stream_filters(cfg).items()}


def feeder_for(copies: Dict[int, FilteredCopy], cfg: LaunchConfig, local_rank: int, stream: int,
               prefix: str) -> Optional[LineFeeder]:
    """The feeder of ``local_rank``'s ``stream`` into its attempt's file, or None when it is not copied."""
    if stream not in copies or not copied(cfg, local_rank, stream):
        return None
    return copies[stream].feeder(prefix)


__all__ = ["FILTERED_NAMES", "FilteredCopy", "LineFeeder", "copied", "feeder_for", "open_filtered",
           "stream_filters", "unfed_warnings"]
