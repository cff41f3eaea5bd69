"""GPU smoke check of the CUDA/NCCL path (run on a GPU machine; not part of CI).

    elasticrun --standalone --nproc-per-node gpu tests/scripts/gpu_check.py CKPT_DIR [--fail-once]

Checks: the backend is nccl, LOCAL_RANK bound to its GPU, an all-reduce, a checkpoint of CUDA tensors saved and
loaded bit-identically, and (--fail-once) a crashed NCCL worker restarted once.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import elasticrun.train as et
from elasticrun.checkpoint import load, save


@record
def main() -> None:
    root = sys.argv[1]
    ctx = et.init()
    local_rank = int(os.environ["LOCAL_RANK"])
    assert ctx.backend == "nccl", f"backend {ctx.backend}"
    assert ctx.device == torch.device("cuda", local_rank), ctx.device
    assert torch.cuda.current_device() == local_rank
    t = torch.full((1024,), float(ctx.rank + 1), device=ctx.device)
    dist.all_reduce(t)
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    assert torch.all(t == expected), t[:4]
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if "--fail-once" in sys.argv and restart == 0 and ctx.rank == 0:
        raise RuntimeError("planned failure on the GPU path")
    gen = torch.Generator(device="cuda").manual_seed(1234)
    state = {"w": torch.randn(256, 256, device=ctx.device, generator=gen), "b": torch.arange(7, device=ctx.device),
             "big": torch.randn(80 << 10, 1024, device=ctx.device, generator=gen)}  # 320 MiB: several files
    name = save(state, root, f"gpu-r{restart}", process_group=ctx.cpu_process_group)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    res = load(root, name, state_dict=into, process_group=ctx.cpu_process_group)
    assert all(torch.equal(into[k], state[k]) for k in state)
    fresh = load(root, name, process_group=ctx.cpu_process_group).state_dict  # CPU, memory-mapped
    assert all(torch.equal(fresh[k], state[k].cpu()) for k in state)
    print(f"GPU_CHECK_OK rank={ctx.rank} world={ctx.world_size} device={torch.cuda.get_device_name(local_rank)} "
          f"backend={ctx.backend} restart={restart} ckpt={name} files={len(res.meta.files)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
