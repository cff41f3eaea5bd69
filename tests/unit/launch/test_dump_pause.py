"""A worker's stack dump that arrives in pieces, with pauses inside a frame line (a loaded host deschedules
the worker mid-write): the console still shows it without elasticrun's own frames (launch/logs.py)."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import elasticrun.launch.logs as logs
from elasticrun.launch.logs import FLUSH_PAUSE_S, Console, DumpFilter, OutputPump

PKG = Path(logs.__file__).resolve().parent.parent
HEADER = b"Current thread 0x00007f00 (most recent call first):\n"


def test_a_frame_line_cut_by_a_pause_is_still_left_out_of_the_console() -> None:
    own = f'  File "{PKG}/launch/warm.py", line 275 in <module>\n'.encode()
    pieces = [HEADER, b'  File "/job/train.py", line 42 in <module>\n', own[:20], own[20:], b"step 7", b" done\n"]
    stream = io.BytesIO()
    read, write = os.pipe()
    pump = OutputPump(os.fdopen(read, "rb", buffering=0), "[n/0]:", Console(stream), None)
    for piece in pieces:
        os.write(write, piece)
        time.sleep(3 * FLUSH_PAUSE_S)  # a pause longer than the one after which an unfinished line is shown
    os.close(write)
    pump.join(10)
    assert pump.done
    shown = stream.getvalue()
    assert b"/job/train.py" in shown and b"warm.py" not in shown and PKG.name.encode() + b"/launch" not in shown, shown
    assert shown.endswith(b"[n/0]:step 7 done\n"), shown  # a line that is not a frame still shows at its pause


def test_an_empty_read_inside_a_dump_does_not_let_the_next_frame_through() -> None:
    """The pump passes what it read up to the last line end: nothing, when a read ended inside a line."""
    f = DumpFilter()
    own = f'  File "{PKG}/launch/warm.py", line 275 in <module>\n'.encode()
    assert f(HEADER) == HEADER and f(b"") == b"" and f(own) == b""
