"""The smallest elastic script that re-forms in place (see docs/training.md, "In-place re-forming").

    elasticrun --nnodes 1:4 --nproc-per-node 1 --rdzv-endpoint HOST:2379 examples/inplace.py

Under torchrun or plain python it trains exactly as it would without ``InPlace``. ``InPlace`` comes
before DDP (or any other collective): a newcomer receives the survivors' state inside it, in the same
order of collectives as the survivors' re-form. On a GPU node the model trains on ``ctx.device``.
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
    loss = torch.nn.functional.mse_loss(ddp(batch[:, :16]), batch[:, 16:])
    opt.zero_grad()
    loss.backward()
    opt.step()
    sampler.advance(32)
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
