"""Test worker for output and failure reporting (no torch). OUT_MODE picks what it does:

- ``progress``: rank 0 writes ``step 3\\r`` (no newline) to stderr, then waits for the file
  OUT_GO (the test creates it once it saw ``step 3``), then writes ``step 4\\n``.
- ``boom``: raises ``RuntimeError("boom-xyz")`` (no @record, so no error file).
- ``bigerror``: at restart 0, writes a 3 MB error file at TORCHELASTIC_ERROR_FILE and exits 1;
  later attempts exit 0.
- ``whoami``: prints ``file=<__file__> argv0=<sys.argv[0]> pooled=<bool>`` then raises ``ValueError("whoami-err")``
  at restart 0 (exit 0 later).
- ``gloo``: prints ``[rank<RANK>]: about to fail [bold]`` on stderr, then raises gloo's real timeout text
  (``RuntimeError: [/__w/pytorch/.../unbound_buffer.cc:78] Timed out ...``: brackets rich would read as markup).
- ``many``: writes ``OUT_LINES`` lines ``rank=<RANK> line=<i> xxx…`` to stdout, each in two writes
  (a line's end arrives separately, as ``print`` does unbuffered; every 4th after 2 ms), all ranks at once.
- ``lines``: prints ``line-out rank=<RANK>`` to stdout and ``line-err rank=<RANK>`` to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time

GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                "Timed out waiting 1800000ms for recv operation to complete [/red]")


def _progress() -> None:
    if os.environ.get("LOCAL_RANK") != "0":
        return
    sys.stderr.write("step 3\r")
    sys.stderr.flush()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["OUT_GO"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.stderr.write("step 4\n")


def _bigerror() -> int:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") != "0":
        return 0
    blob = "x" * (3 * 1024 * 1024)
    data = {"message": {"message": f"RuntimeError: big-error {blob}",
                        "extraInfo": {"py_callstack": blob, "timestamp": str(int(time.time()))}}}
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump(data, f)
    return 1


def main() -> int:
    mode = os.environ.get("OUT_MODE", "lines")
    rank = os.environ.get("RANK", "?")
    if mode == "progress":
        _progress()
    elif mode == "boom":
        print("about to fail", file=sys.stderr, flush=True)
        raise RuntimeError("boom-xyz")
    elif mode == "gloo":
        print(f"[rank{rank}]: about to fail [bold]", file=sys.stderr, flush=True)
        raise RuntimeError(GLOO_TIMEOUT)
    elif mode == "many":
        for i in range(int(os.environ.get("OUT_LINES", "300"))):
            sys.stdout.write(f"rank={rank} line={i} ")
            if i % 4 == 0:
                time.sleep(0.002)  # a short pause inside the line (well below the launcher's flush pause)
            sys.stdout.write("x" * 40 + "\n")
        sys.stdout.flush()
    elif mode == "bigerror":
        return _bigerror()
    elif mode == "whoami":
        pooled = "elasticrun.launch.warm" in " ".join(getattr(sys, "orig_argv", []))  # from the standby pool
        print(f"file={__file__} argv0={sys.argv[0]} pooled={pooled}", flush=True)
        if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            raise ValueError("whoami-err")
    else:
        print(f"line-out rank={rank}", flush=True)
        print(f"line-err rank={rank}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
