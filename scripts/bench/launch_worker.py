"""Worker for scripts/bench/bench_launch.py: a tiny DDP model on gloo that logs every step, and crashes once on demand.

Every rank first prints ``bench-start t=<unix time> rank=<RANK>`` (its script's first line, before any import);
rank 0 prints ``bench-step <n> t=<unix time> restart=<TORCHELASTIC_RESTART_COUNT> world=<WORLD_SIZE>`` after
every optimizer step. With BENCH_CRASH_STEP=k, the last rank prints
``bench-crash t=<unix time>`` and exits 1 at step k of the first attempt (restart count 0) only. With
BENCH_CRASH_AFTER_S=s instead, that rank does so s seconds after its script started, at whatever it is doing
then (still in init_process_group, building DDP, or training); with BENCH_CRASH_ONCE_FILE, only the first
worker to create that file crashes (torchrun may give the crashing rank to a node whose restart count is 0).
BENCH_STEPS (default 5) steps are run per attempt, BENCH_STEP_S (default 0.2) seconds apart.
"""

from __future__ import annotations

import os
import time

print(f"bench-start t={time.time():.4f} rank={os.environ.get('RANK')}", flush=True)

import torch  # noqa: E402 - after the first line: the bench times the script's start
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def _crash_later(seconds: float) -> None:
    """Exit 1 after ``seconds``, from a timer thread: a crash at any moment of the worker's life."""
    import threading

    def crash() -> None:
        once = os.environ.get("BENCH_CRASH_ONCE_FILE")
        if once:
            try:
                os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
        print(f"bench-crash t={time.time():.4f}", flush=True)
        os._exit(1)

    timer = threading.Timer(seconds, crash)
    timer.daemon = True
    timer.start()


def main() -> None:
    crash_after = os.environ.get("BENCH_CRASH_AFTER_S")
    if crash_after and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
            _crash_later(float(crash_after))
    cuda = os.environ.get("BENCH_DEVICE") == "cuda"  # bench_launch.py --device cuda: NCCL, one GPU per worker
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    crash_step = int(os.environ.get("BENCH_CRASH_STEP", "0"))
    steps = int(os.environ.get("BENCH_STEPS", "5"))
    pause = float(os.environ.get("BENCH_STEP_S", "0.2"))
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        if crash_step and restart == 0 and step == crash_step and rank == world - 1:
            print(f"bench-crash t={time.time():.4f}", flush=True)
            os._exit(1)
        loss = model(torch.randn(8, 64, device=device)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"bench-step {step} t={time.time():.4f} restart={restart} world={world}", flush=True)
        time.sleep(pause)
    # Free DDP before the group: were its Reducer to drop the group's last reference, the gloo
    # destructor would join its worker thread with the GIL held (a known torch exit deadlock).
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
