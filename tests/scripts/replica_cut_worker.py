"""Test worker: a replica transfer that cannot end, and the close of its Replicator (memory tier).

Two ranks (``RANK``, ``WORLD_SIZE=2``, ``MASTER_ADDR``/``MASTER_PORT``), each with a real ``Replicator`` (its own
gloo group). Rank 0's thread starts a transfer (a generation it does not have: only the header exchange) and
waits for rank 1's header, which never comes: rank 1 takes rank 0's header on its main thread and answers
nothing, as a peer whose replicator found the group destroyed by a re-form. ``REPLICA_MODE=destroyed``: once
rank 0's thread waits, both ranks destroy their process groups (the re-form), rank 0 waits for its replicas
without a timeout (the wait must return by itself) and closes its replicator; ``REPLICA_MODE=alive``: the
groups stay and rank 0 closes with a 1 s timeout. Rank 0 writes ``$REPLICA_OUT`` (JSON: how long the wait and
``close`` took, the errors recorded, whether the thread still runs); rank 1 keeps its connections open until
that file exists. Both end with ``os._exit``: without the cut, rank 0's
thread would still wait in gloo when the interpreter finalizes.
"""

from __future__ import annotations

import json
import linecache
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from elasticrun.checkpoint.memory.commit import NodeLayout
from elasticrun.checkpoint.memory.replicas import Replicator


def waits_in_recv(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside ``torch.distributed.recv``'s wait for the data."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "recv" and code.co_filename.endswith("distributed_c10d.py"):
            return ".wait(" in linecache.getline(code.co_filename, frame.f_lineno)
        frame = frame.f_back
    return False


def main() -> None:
    rank, out, mode = int(os.environ["RANK"]), os.environ["REPLICA_OUT"], os.environ["REPLICA_MODE"]
    dist.init_process_group("gloo", init_method="env://")
    replicator = Replicator(None, os.path.join(os.environ["REPLICA_BASE"], str(rank)), keep=2)
    if rank == 0:
        replicator.submit("snap-00000001-1", NodeLayout([[0], [1]], 0))
        deadline = time.monotonic() + 60
        while not waits_in_recv(replicator._thread):
            if time.monotonic() > deadline:
                sys.exit("rank 0's replicator never waited for rank 1's header")
            time.sleep(0.01)
    else:
        head = torch.zeros(2, dtype=torch.int64)
        dist.recv(head, src=0, group=replicator.group, tag=1)  # the first transfer's tag
    dist.barrier()
    if mode == "destroyed":
        dist.destroy_process_group()
    if rank == 0:
        ended = waited_s = None
        if mode == "destroyed":  # a wait with no timeout: on a destroyed group it must return by itself
            t0 = time.monotonic()
            ended = replicator.wait()
            waited_s = time.monotonic() - t0
        t0 = time.monotonic()
        replicator.close(timeout=1.0 if mode == "alive" else 60.0)
        row = {"close_s": time.monotonic() - t0, "wait_s": waited_s, "wait_ended": ended, "errors": replicator.errors,
               "thread_alive": replicator._thread.is_alive()}
        with open(out + ".tmp", "w", encoding="utf-8") as f:
            json.dump(row, f)
        os.replace(out + ".tmp", out)
    else:
        deadline = time.monotonic() + 120
        while not os.path.exists(out) and time.monotonic() < deadline:
            time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
