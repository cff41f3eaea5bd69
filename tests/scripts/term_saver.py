"""Test worker (no torch): runs until a signal, records which one, "saves", exits.

usage: term_saver.py OUT_DIR
Writes OUT_DIR/<rank>.pid at start and a step count to OUT_DIR/<rank>.steps every 0.1 s; on
SIGTERM or SIGINT writes OUT_DIR/<rank>.<SIGNAME> (the "save") and exits 143/130. Any other
signal that kills it leaves no such file. ARGV_OUT=path: also write len(argv) and the sha256
of the NUL-joined arguments there (big-argv tests).
"""

import hashlib
import os
import signal
import sys
import time


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def main() -> int:
    out = sys.argv[1]
    rank = os.environ.get("RANK", "0")
    argv_out = os.environ.get("ARGV_OUT")
    if argv_out:
        digest = hashlib.sha256("\0".join(sys.argv[1:]).encode()).hexdigest()
        _write(f"{argv_out}.{rank}", f"{len(sys.argv) - 1} {digest}")
        return 0
    stop = []

    def on_signal(signum, _frame) -> None:
        stop.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _write(os.path.join(out, f"{rank}.pid"), str(os.getpid()))
    steps = 0
    while not stop:
        time.sleep(0.1)
        steps += 1
        _write(os.path.join(out, f"{rank}.steps"), str(steps))
    _write(os.path.join(out, f"{rank}.{signal.Signals(stop[0]).name}"), str(steps))
    return 128 + stop[0]


if __name__ == "__main__":
    sys.exit(main())
