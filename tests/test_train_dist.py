"""init(), the agreed stop/checkpoint decision and the sampler with real gloo process groups."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
import torch.multiprocessing as mp

pytestmark = pytest.mark.integration  # starts etcd or processes

WORLD = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        ELASTICRUN_ROUND="2", ELASTICRUN_PREV_WORLD_SIZE="4", ELASTICRUN_RESCALE_TYPE="ScaleDown",
        ELASTICRUN_RDZV_ENDPOINT="",
    )
    import torch.distributed as dist

    import elasticrun.train as et

    ctx = et.init(timeout=60)
    res: dict = {"rank": ctx.rank, "world": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device),
                 "round": ctx.round, "prev": ctx.prev_world_size, "type": ctx.rescale_type.value}
    req = et.CheckpointRequests(ctx, every=1)
    d0 = req.poll(0, stop=ctx.should_stop)
    res["d0"] = [d0.stop, list(d0.request_ids), d0.checked]
    if rank == 0:  # what the etcd watcher does when `elasticrun ckpt save` writes a request
        req._offer("req-b", 2.0)
        req._offer("req-a", 1.0)
    d1 = req.poll(1, stop=ctx.should_stop)
    res["d1"] = [d1.stop, list(d1.request_ids), d1.checkpoint]
    d2 = req.poll(2, stop=ctx.should_stop)  # handed out once only
    res["d2"] = list(d2.request_ids)
    if rank == 1:  # the agent's SIGTERM reaches one worker a little earlier than the others
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not ctx.should_stop and time.monotonic() < deadline:
            time.sleep(0.001)
    res["local_stop"] = ctx.should_stop
    d3 = req.poll(3, stop=ctx.should_stop)
    res["d3"] = [d3.stop, d3.checkpoint]
    sparse = et.CheckpointRequests(ctx, every=4)
    res["sparse"] = [sparse.poll(s).checked for s in range(1, 9)]
    auto = et.CheckpointRequests(ctx, period=0.2)  # every="auto": agree about every 0.2 s
    checked = []
    for s in range(40):
        time.sleep(0.01)  # a 10 ms training step
        checked.append(auto.poll(s).checked)
    res["auto_checked"] = checked
    # cost of the agreement (gloo, loopback)
    n = 50
    t0 = time.perf_counter()
    for s in range(n):
        req.poll(s)
    res["poll_ms"] = 1000 * (time.perf_counter() - t0) / n
    # the sampler picks world/rank from the process group and partitions the remainder
    sampler = et.ElasticDistributedSampler(103, seed=3, tail="uneven")
    sampler.load_state_dict({"epoch": 0, "samples_consumed": 40})
    mine = list(sampler)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    res["sampler_union"] = sorted(i for part in everyone for i in part)
    res["sampler_expected"] = sorted(sampler.permutation()[40:])
    req.close()
    ctx.close()
    res["closed"] = not dist.is_initialized()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def test_three_ranks_agree_on_requests_and_stop(tmp_path):
    ctx = mp.start_processes(_worker, args=(WORLD, free_port(), str(tmp_path)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 90
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("workers did not finish within 90 s")
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, x in enumerate(res):
        assert (x["rank"], x["world"], x["backend"], x["device"]) == (r, WORLD, "gloo", "cpu")
        assert (x["round"], x["prev"], x["type"]) == (2, 4, "ScaleDown")
        assert x["d0"] == [False, [], True]
        assert x["d1"] == [False, ["req-a", "req-b"], True], "every rank sees rank 0's requests, oldest first"
        assert x["d2"] == []
        assert x["local_stop"] == (r == 1), "SIGTERM sets the local flag only"
        assert x["d3"] == [True, True], "one rank's SIGTERM stops every rank at the same step"
        assert x["sparse"] == [False, False, False, True, False, False, False, True]
        assert x["sampler_union"] == x["sampler_expected"]
        assert x["closed"]
    auto = [x["auto_checked"] for x in res]
    assert auto[0] == auto[1] == auto[2], "every rank agrees at the same steps"
    assert auto[0][:2] == [True, True] and 3 <= sum(auto[0]) < 30, auto[0]
    print(f"poll() agreement: {res[0]['poll_ms']:.3f} ms per step (gloo, {WORLD} ranks)")
    assert res[0]["poll_ms"] < 50
