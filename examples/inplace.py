"""The smallest elastic script that re-forms in place (see docs/training.md, "In-place re-forming").

    elasticrun --nnodes 1:4 --nproc-per-node 1 --rdzv-endpoint HOST:2379 examples/inplace.py

Under torchrun or plain python it trains exactly as it would without ``InPlace``. ``InPlace`` comes
before DDP (or any other collective): a newcomer receives the survivors' state inside it, in the same
order of collectives as the survivors' re-form. On a GPU node the model trains on ``ctx.device``.
A step whose all-reduce fails because another node's worker crashed is handed to ``recover``: the
survivors re-form with the crashed rank's replacement and redo the step.
"""

import torch
import torch.distributed as dist

import elasticrun.train as et

ctx = et.init()
torch.manual_seed(0)
model = torch.nn.Linear(16, 1).to(ctx.device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.randn(4096, 17).to(ctx.device)
sampler = et.ElasticDistributedSampler(len(data), seed=0)
inplace = et.InPlace(ctx, model=model, optimizer=opt, sampler=sampler)  # opts in; newcomers get the state here
ddp = torch.nn.parallel.DistributedDataParallel(model)  # after InPlace: its collectives come first

while not sampler.epoch_done:
    batch = data[list(iter(sampler))[:32]]
    try:
        opt.zero_grad()  # first: a step redone after a crash starts from no gradients
        loss = torch.nn.functional.mse_loss(ddp(batch[:, :16]), batch[:, 16:])
        loss.backward()  # DDP's all-reduce fails when a peer crashed (gloo)
        opt.step()  # NCCL: InPlace's hook refuses the step when a peer's crash aborted the all-reduce
    except RuntimeError as err:
        if inplace.recover(err) is et.Reform.STOP:  # re-raises unless the crash is recovered in place
            break
        ddp = et.rebuild_ddp(ddp)  # re-formed with the crashed rank's replacement: redo the step
        continue
    sampler.advance(32)  # only after the step's last collective
    inplace.step += 1
    result = inplace.check()  # step boundary: collective, every rank
    if result is et.Reform.STOP:  # SIGTERM: this worker leaves (save here if you need to)
        break
    if result is et.Reform.REFORMED:  # a new world: the old group (and DDP's) is gone
        ddp = et.rebuild_ddp(ddp)
        if ctx.is_rank0:
            print(f"re-formed in place: world {ctx.world_size} (round {ctx.round}, {inplace.last_pause_s:.2f} s)")
if dist.is_initialized():
    ctx.close()
