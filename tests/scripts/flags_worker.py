"""Test worker (no torch) for torchrun's flags: its environment and CPU affinity, and lines to filter.

Writes ``<argv[1]>/rank<RANK>.json``: LOCAL_RANK, CUDA_VISIBLE_DEVICES, ELASTICRUN_LOCAL_RANK, the
affinity of every thread (``os.sched_getaffinity``). Then prints a fixed set of lines, each with one
write, to stdout and stderr (some match the tests' --duplicate-*-filters, some do not).
"""

from __future__ import annotations

import json
import os
import sys

NAMES = ("RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "ELASTICRUN_LOCAL_RANK", "LOCAL_WORLD_SIZE")


def main() -> None:
    rank = os.environ["RANK"]
    threads = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
    record = {name: os.environ.get(name) for name in NAMES}
    record.update(affinity=sorted(os.sched_getaffinity(0)), threads=threads)
    path = os.path.join(sys.argv[1], f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    for line in (f"apple pie from {rank}", f"banana from {rank}", f"orange only from {rank}",
                 f"orange,pear salad from {rank}", f"pineapple from {rank}"):
        sys.stdout.write(line + "\n")  # one write per line: torchrun's tail reads a file as it grows
    sys.stdout.flush()
    for line in (f"kiwi on stderr from {rank}", f"plum on stderr from {rank}"):
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


if __name__ == "__main__":
    main()
