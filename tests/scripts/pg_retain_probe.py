"""Test worker: after ``destroy_process_group()``, who still references the group?

usage: pg_retain_probe.py OUT_FILE
Writes JSON: the default gloo group's Python reference count after ``destroy_process_group()``
besides this script's own variable (``refs``), and ``initialized`` (must be false: destroyed
means unregistered). A plain interpreter holds nothing more (``refs`` 0): had a DDP model still
referenced the group, freeing the model would run the group's destructor from DDP's Reducer
with the GIL held (the exit deadlock's path). A launcher that keeps destroyed groups until
exit shows ``refs`` 1.
"""

import json
import sys

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    dist.destroy_process_group()
    refs = sys.getrefcount(group) - 2  # minus getrefcount's argument and ``group``
    with open(sys.argv[1], "w") as f:
        json.dump({"refs": refs, "initialized": dist.is_initialized()}, f)


if __name__ == "__main__":
    main()
