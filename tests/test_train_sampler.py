"""ElasticDistributedSampler: deterministic epochs, exact resume at any world size."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import List

import pytest

from elasticrun.errors import ConfigError
from elasticrun.train import ElasticDistributedSampler


def samplers(n: int, world: int, state=None, **kw) -> List[ElasticDistributedSampler]:
    out = []
    for r in range(world):
        s = ElasticDistributedSampler(n, num_replicas=world, rank=r, **kw)
        if state is not None:
            s.load_state_dict(json.loads(json.dumps(state)))  # the state must survive JSON
        out.append(s)
    return out


def run_steps(group: List[ElasticDistributedSampler], batch: int, steps: int) -> List[int]:
    """Every rank takes ``steps`` batches of ``batch`` in lockstep; returns the indices trained on."""
    iters = [iter(s) for s in group]
    seen = []
    for _ in range(steps):
        sizes = []
        for it in iters:
            got = [i for _, i in zip(range(batch), it)]
            seen.extend(got)
            sizes.append(len(got))
        assert len(set(sizes)) == 1, f"ranks took different batch sizes {sizes}"
        if sizes[0] == 0:
            break
        for s in group:
            s.advance(sizes[0])
    return seen


def test_permutation_is_deterministic_and_epoch_dependent():
    a = ElasticDistributedSampler(50, 2, 0, seed=7)
    b = ElasticDistributedSampler(50, 3, 2, seed=7)
    assert a.permutation(0) == b.permutation(0)
    assert sorted(a.permutation(0)) == list(range(50))
    assert a.permutation(0) != a.permutation(1)
    assert ElasticDistributedSampler(50, 1, 0, seed=8).permutation(0) != a.permutation(0)
    assert ElasticDistributedSampler(5, 1, 0, shuffle=False).permutation(3) == [0, 1, 2, 3, 4]


def test_rescale_4_to_3_to_2_covers_epoch_exactly_once():
    n, batch = 103, 4
    g4 = samplers(n, 4, seed=1, tail="uneven")
    seen = run_steps(g4, batch, 3)  # 48 samples at world 4
    state = g4[0].state_dict()
    assert state["samples_consumed"] == 48
    g3 = samplers(n, 3, state, seed=1, tail="uneven")
    seen += run_steps(g3, batch, 2)  # 24 more at world 3
    state = g3[1].state_dict()
    assert state["samples_consumed"] == 72
    g2 = samplers(n, 2, state, seed=1, tail="uneven")
    rest = [i for s in g2 for i in s]  # the rest of the epoch at world 2
    seen += rest
    assert len(rest) == n - 72
    assert Counter(seen) == Counter(range(n)), "every sample of the epoch exactly once"


@pytest.mark.parametrize("tail", ["pad", "drop", "uneven"])
def test_random_rescales_never_repeat_consumed_samples(tail):
    rng = random.Random(1234)
    for _ in range(200):
        n = rng.randint(0, 120)
        batch = rng.randint(1, 6)
        seed = rng.randint(0, 10)
        state, seen = None, []
        while True:
            world = rng.randint(1, 5)
            group = samplers(n, world, state, seed=seed, tail=tail)
            lengths = {len(s) for s in group}
            if tail != "uneven":
                assert len(lengths) == 1, "pad/drop give every rank the same number of samples"
            before = group[0].samples_consumed
            steps = rng.randint(1, 4)
            if tail == "uneven":
                # lockstep only while every rank still has a full batch
                steps = min(steps, min(lengths) // batch)
            got = run_steps(group, batch, steps)
            consumed = group[0].samples_consumed
            # what was trained on is exactly the next stretch of the epoch's permutation
            perm = group[0].permutation()
            if tail == "pad":  # the final step may wrap around to the start of the remainder
                assert set(perm[before:consumed]) <= set(got) <= set(perm[before:])
            else:
                assert set(got) == set(perm[before:consumed])
            seen += got
            state = group[0].state_dict()
            if steps == 0 or consumed >= n or not got:
                break
        if tail == "pad":
            repeats = sum(c - 1 for c in Counter(seen).values())
            assert repeats < 5  # only the final wrap-around of one step may repeat
        else:
            assert len(seen) == len(set(seen)), "no sample repeated within the epoch"


def test_tail_modes_at_world_4():
    n = 10
    pad = samplers(n, 4, seed=0, tail="pad")
    assert [len(s) for s in pad] == [3, 3, 3, 3]
    got = [i for s in pad for i in s]
    assert set(got) == set(range(n)) and len(got) == 12
    drop = samplers(n, 4, seed=0, tail="drop")
    assert [len(s) for s in drop] == [2, 2, 2, 2]
    assert len({i for s in drop for i in s}) == 8
    uneven = samplers(n, 4, seed=0, tail="uneven")
    assert [len(s) for s in uneven] == [3, 3, 2, 2]
    assert sorted(i for s in uneven for i in s) == list(range(n))
    assert [len(list(s)) for s in uneven] == [3, 3, 2, 2]


def test_pad_with_fewer_samples_than_ranks():
    g = samplers(10, 4, {"epoch": 0, "samples_consumed": 9}, tail="pad")
    assert [len(list(s)) for s in g] == [1, 1, 1, 1]
    assert len({i for s in g for i in s}) == 1


def test_set_epoch_keeps_resume_position_only_for_same_epoch():
    s = ElasticDistributedSampler(20, 2, 0)
    s.load_state_dict({"epoch": 3, "samples_consumed": 8})
    s.set_epoch(3)
    assert s.samples_consumed == 8 and len(s) == 6
    s.set_epoch(4)
    assert s.samples_consumed == 0 and len(s) == 10 and not s.epoch_done


def test_advance_caps_at_dataset_size():
    s = ElasticDistributedSampler(10, 4, 0)
    assert s.advance(2) == 8
    assert s.advance(1) == 10 and s.epoch_done and s.remaining == 0


def test_bad_input_is_a_clear_error():
    with pytest.raises(ConfigError, match="tail must be"):
        ElasticDistributedSampler(10, 2, 0, tail="wrap")
    with pytest.raises(ConfigError, match="rank 2 is outside"):
        ElasticDistributedSampler(10, 2, 2)
    s = ElasticDistributedSampler(10, 2, 0, seed=1)
    with pytest.raises(ConfigError, match="dataset of 11 samples"):
        s.load_state_dict({"num_samples": 11, "samples_consumed": 0})
    with pytest.raises(ConfigError, match="seed=2"):
        s.load_state_dict({"seed": 2})
    with pytest.raises(ConfigError, match="outside 0..10"):
        s.load_state_dict({"samples_consumed": 11})


def test_works_with_dataloader():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(torch.arange(30))
    s = ElasticDistributedSampler(ds, num_replicas=3, rank=1, seed=5)
    s.load_state_dict({"epoch": 0, "samples_consumed": 12})
    batches = [b[0].tolist() for b in DataLoader(ds, batch_size=4, sampler=s)]
    flat = [i for b in batches for i in b]
    assert flat == s.permutation()[12:][1::3]
    assert [len(b) for b in batches] == [4, 2]
