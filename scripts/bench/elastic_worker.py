"""The training loops the benches run under a launcher: ``elastic_worker.py MODE [OUT_DIR]``.

``launch`` (bench_launch.py): a tiny DDP model, BENCH_STEPS steps BENCH_STEP_S apart; in the first attempt the last
rank prints ``bench-crash t=<unix time>`` and exits 1 at step BENCH_CRASH_STEP, or BENCH_CRASH_AFTER_S s after its
start (then only the first worker to create BENCH_CRASH_ONCE_FILE: torchrun counts restarts per agent).
``bench``: an all-reduce and a 0.1 s sleep per step, resuming from OUT_DIR/progress.json; ``inplace``: that loop
with elasticrun.train.InPlace (re-forms in place under elasticrun); ``plain``: a tight all-reduce loop from step 0
that handles no signal. ``bench`` and ``inplace`` write their pid to OUT_DIR/pid-<RANK>.
Every rank first prints ``bench-start t=<unix time>``; rank 0 prints ``STEP <n> WORLD <w> TIME <unix time>`` (``plain``:
at most 20 a second), ``w`` all-reduced: the ranks that took part.
"""

from __future__ import annotations

import os
import sys
import time

print(f"bench-start t={time.time():.4f} rank={os.environ.get('RANK')}", flush=True)

import json  # noqa: E402 - after the first line: bench_launch.py times the script's start
import threading  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def world() -> int:
    """The number of ranks that took part in one all-reduce."""
    x = torch.ones(1)
    dist.all_reduce(x)
    return int(x.item())


def note_pid(out_dir: str) -> None:
    with open(os.path.join(out_dir, f"pid-{os.environ.get('RANK', '0')}"), "w") as f:
        f.write(str(os.getpid()))


def crash() -> None:
    """Print ``bench-crash`` and exit 1 (not when another worker created BENCH_CRASH_ONCE_FILE first)."""
    once = os.environ.get("BENCH_CRASH_ONCE_FILE")
    try:
        if once:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    print(f"bench-crash t={time.time():.4f}", flush=True)
    os._exit(1)


def launch(_out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    crashes = first_attempt and int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1
    if crashes and os.environ.get("BENCH_CRASH_AFTER_S"):
        timer = threading.Timer(float(os.environ["BENCH_CRASH_AFTER_S"]), crash)  # at any moment of its life
        timer.daemon = True
        timer.start()
    cuda = os.environ.get("BENCH_DEVICE") == "cuda"  # NCCL, one GPU per worker
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(64, 64).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, int(os.environ.get("BENCH_STEPS", "5")) + 1):
        if crashes and step == int(os.environ.get("BENCH_CRASH_STEP", "0")):
            crash()
        loss = model(torch.randn(8, 64, device=device)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if dist.get_rank() == 0:
            print(f"STEP {step} WORLD {dist.get_world_size()} TIME {time.time():.4f}", flush=True)
        time.sleep(float(os.environ.get("BENCH_STEP_S", "0.2")))
    # Free DDP before the group: were its Reducer to drop the group's last reference, the gloo
    # destructor would join its worker thread with the GIL held (a known torch exit deadlock).
    del model, opt
    dist.destroy_process_group()


def bench(out_dir: str) -> None:
    note_pid(out_dir)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    progress = os.path.join(out_dir, "progress.json")
    start = torch.zeros(1)
    if rank == 0 and os.path.exists(progress):
        with open(progress) as f:
            start += json.load(f)["next_step"]
    dist.broadcast(start, 0)
    step = int(start.item())
    while True:
        w = world()
        if rank == 0:
            print(f"STEP {step} WORLD {w} TIME {time.time():.3f}", flush=True)
            with open(f"{progress}.tmp", "w") as f:
                json.dump({"next_step": step + 1}, f)
            os.replace(f"{progress}.tmp", progress)
        step += 1
        time.sleep(0.1)


def inplace(out_dir: str) -> None:
    import elasticrun.train as et

    note_pid(out_dir)
    ctx = et.init()
    model = torch.nn.Linear(256, 256)
    reform = et.InPlace(ctx, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
    while True:
        try:
            w = world()
        except RuntimeError as err:  # a peer crashed: re-form in place (or re-raise: the restart path)
            if reform.recover(err) is et.Reform.STOP:
                break
            continue
        if ctx.is_rank0:
            print(f"STEP {reform.step} WORLD {w} TIME {time.time():.3f}", flush=True)
        reform.step += 1
        time.sleep(0.1)
        if reform.check() is et.Reform.STOP:
            break
    ctx.close()


def plain(_out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    x = torch.ones(1 << 16)
    step, last = 0, 0.0
    while True:
        x.fill_(1.0)
        dist.all_reduce(x)
        w, now = world(), time.time()
        if rank == 0 and now - last >= 0.05:
            print(f"STEP {step} WORLD {w} TIME {now:.3f}", flush=True)
            last = now
        step += 1


if __name__ == "__main__":
    modes = {"launch": launch, "bench": bench, "inplace": inplace, "plain": plain}
    if len(sys.argv) not in (2, 3) or sys.argv[1] not in modes or (sys.argv[1] != "launch" and len(sys.argv) < 3):
        sys.exit("usage: elastic_worker.py launch|bench|inplace|plain [OUT_DIR]   (under a launcher)")
    modes[sys.argv[1]]((sys.argv + [""])[2])
