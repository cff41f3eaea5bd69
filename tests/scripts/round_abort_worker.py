"""Test worker for ending a broken round's groups from another thread (elasticrun/train/abort.py), over gloo.

Two ranks (``RANK``, ``WORLD_SIZE=2``, ``MASTER_ADDR``/``MASTER_PORT``), a default group and one more
gloo group with a 60 s timeout, their sockets recorded as ``et.init`` records them. Rank 1 arms a
``BreakWatch`` whose word is the file ``$ABORT_WORD`` (with the real ``cut`` and ``abort_all_groups``),
writes ``$ABORT_OUT.blocked`` and all-reduces on the extra group, which rank 0 never joins: it blocks
(rank 0 keeps its connections open, so nothing but the abort can end it). Once rank 1's all-reduce
raised it destroys the groups, and both ranks form a new world at ``NEXT_PORT`` and all-reduce there,
as a re-form does. Rank 1 writes ``$ABORT_OUT`` (JSON: what raised, after how long since the word, the
new world's sum); rank 0 waits for that file before it joins the new world.

With ``ABORT_MODE=stuck`` the cut finds nothing to shut down (as when gloo had closed the connection
itself without failing the collective) and the all-reduce waits through ``abort.finish``, which must give it
up on its own once the watch fired; the extra group's timeout is then ``GROUP_TIMEOUT_S`` (default 60).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import time

import torch
import torch.distributed as dist

from elasticrun.sockets import OpenedSockets
from elasticrun.train.abort import BreakWatch, abort_all_groups, finish

rank = int(os.environ["RANK"])
word, out = os.environ["ABORT_WORD"], os.environ["ABORT_OUT"]
sockets = OpenedSockets()
with sockets.watch():
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(
        seconds=float(os.environ.get("GROUP_TIMEOUT_S", "60"))))
stuck = os.environ.get("ABORT_MODE") == "stuck"
row = {}
if rank == 1:
    watch = BreakWatch(lambda: 0, lambda r: os.path.exists(word), interval=0.01)
    watch.arm(0, (lambda: 0) if stuck else sockets.cut, abort_all_groups)
    watch.start()
    open(out + ".blocked", "w").close()
    try:
        if stuck:
            finish(dist.all_reduce(torch.ones(1), group=group, async_op=True), group)
        else:
            dist.all_reduce(torch.ones(1), group=group)
        row["raised"] = None
    except RuntimeError as err:
        row["raised"] = type(err).__name__
        row["message"] = str(err)
        row["after_word_s"] = time.time() - os.path.getmtime(word)
    row["fired"] = watch.fired
    row["world_size_after_abort"] = dist.get_world_size()  # the groups stay registered until destroyed
    watch.stop()
    dist.destroy_process_group()
    del group  # the script's last reference, as a re-form drops its old group: no destructor may join
    gc.collect()  # gloo's thread that still waits (stuck mode)
else:
    deadline = time.monotonic() + 90
    while not os.path.exists(out + ".raised") and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.destroy_process_group()
os.environ["MASTER_PORT"] = os.environ["NEXT_PORT"]
if rank == 1:
    open(out + ".raised", "w").close()
dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
if rank == 1:
    row["new_world_sum"] = float(t.item())
    with open(out + ".tmp", "w") as f:
        json.dump(row, f)
    os.replace(out + ".tmp", out)
