"""Save a small checkpoint in a fresh process (used with ELASTICRUN_CKPT_CRASH_AT by the crash tests).

Usage: python ckpt_save_child.py ROOT NAME STEP
"""

from __future__ import annotations

import sys

import torch

from elasticrun.checkpoint import save

if __name__ == "__main__":
    root, name, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # Two tensors of 68 MiB, written as two files in parallel (io_threads=2), each in several
    # pieces, so "shard-write" dies mid-file while another thread is writing too.
    state = {"w": torch.full((17 << 20,), float(step)), "v": torch.full((17 << 20,), -float(step)), "step": step}
    save(state, root, name, training_state={"step": step}, io_threads=2)
