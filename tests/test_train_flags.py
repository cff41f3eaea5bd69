"""The launcher's --lr-scaling / --redistribution / --global-batch-size reach what workers do;
LR warmup; the RNG state saved and restored (or re-derived) per rank."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import elasticrun.train as et
from elasticrun.errors import ConfigError
from elasticrun.job.hints import RedistributionType
from elasticrun.train.rng import REDERIVED, RESTORED

pytestmark = pytest.mark.integration  # starts etcd or processes

REPO = Path(__file__).resolve().parent.parent


def test_scale_lr_without_strategy_uses_the_launchers(monkeypatch):
    monkeypatch.delenv("ELASTICRUN_LR_SCALING", raising=False)
    assert et.scale_lr(0.1, 1, 4) == pytest.approx(0.4), "no launcher: linear, the launcher's default"
    monkeypatch.setenv("ELASTICRUN_LR_SCALING", "sqrt")
    assert et.scale_lr(0.1, 1, 4) == pytest.approx(0.2)
    monkeypatch.setenv("ELASTICRUN_LR_SCALING", "none")
    assert et.scale_lr(0.1, 1, 4) == pytest.approx(0.1)
    assert et.scale_lr(0.1, 1, 4, "linear") == pytest.approx(0.4), "an explicit strategy wins"
    monkeypatch.setenv("ELASTICRUN_LR_SCALING", "cubic")
    with pytest.raises(ConfigError, match="ELASTICRUN_LR_SCALING='cubic' is not linear, sqrt or none"):
        et.scale_lr(0.1, 1, 4)


def test_global_batch_from_the_launcher(monkeypatch):
    monkeypatch.delenv("ELASTICRUN_GLOBAL_BATCH_SIZE", raising=False)
    assert et.default_global_batch() == 0
    monkeypatch.setenv("ELASTICRUN_GLOBAL_BATCH_SIZE", "48")
    assert et.default_global_batch() == 48
    assert [et.accumulation_steps(48, 4, w) for w in (1, 2, 3, 4)] == [12, 6, 4, 3]
    with pytest.raises(ConfigError, match="global batch 48 is not a multiple of world size 5"):
        et.accumulation_steps(48, 4, 5)
    monkeypatch.setenv("ELASTICRUN_GLOBAL_BATCH_SIZE", "lots")
    with pytest.raises(ConfigError, match="ELASTICRUN_GLOBAL_BATCH_SIZE='lots'"):
        et.default_global_batch()


def test_warmup_after_scale_up_only():
    assert [et.warmup_lr(0.3, 0.1, s, 4) for s in range(5)] == pytest.approx([0.15, 0.2, 0.25, 0.3, 0.3])
    assert et.warmup_lr(0.1, 0.3, 0, 4) == 0.1, "a scale-down applies the lower LR at once"
    assert et.warmup_lr(0.3, 0.1, 0, 0) == 0.3


def _resume(saved: dict, world: int, mode: str) -> list:
    """Indices of the rest of the epoch, in global position order, after resuming at ``world``."""
    per_rank = []
    for rank in range(world):
        s = et.ElasticDistributedSampler(60, world, rank, seed=3, redistribution=mode)
        s.load_state_dict(saved)
        per_rank.append(list(iter(s)))
    return [per_rank[r][k] for k in range(len(per_rank[0])) for r in range(world)]


@pytest.mark.parametrize("mode", ["incremental", "full"])
def test_redistribution_changes_the_order_never_the_coverage(mode):
    first = et.ElasticDistributedSampler(60, 3, 0, seed=3, redistribution=mode)
    first.set_epoch(0)
    first.advance(6)  # 18 of 60 consumed at world 3
    saved = first.state_dict()
    rest = _resume(saved, 2, mode)
    perm = first.permutation()
    assert sorted(perm[:18] + rest) == list(range(60)), "exactly once either way"
    if mode == "incremental":
        assert rest == perm[18:], "incremental: the uninterrupted run's order"
    else:
        assert rest != perm[18:], "full: the rest of the epoch is reshuffled"
        assert rest == _resume(saved, 2, mode), "deterministically"
        again = et.ElasticDistributedSampler(60, 2, 0, seed=3, redistribution=mode)
        again.load_state_dict(saved)
        assert again.state_dict()["reshuffles"] == [18]
        assert _resume(saved, 3, mode) == perm[18:], "same world size: nothing to redistribute"


def test_redistribution_from_the_launcher(monkeypatch):
    monkeypatch.setenv("ELASTICRUN_REDISTRIBUTION", "full")
    assert et.ElasticDistributedSampler(10, 1, 0).redistribution is RedistributionType.FULL_RESHUFFLE
    monkeypatch.delenv("ELASTICRUN_REDISTRIBUTION")
    assert et.default_redistribution() is RedistributionType.INCREMENTAL
    with pytest.raises(ConfigError, match="is not 'full' or 'incremental'"):
        et.ElasticDistributedSampler(10, 1, 0, redistribution="sometimes")


def _draws() -> list:
    return [float(torch.rand(1)), random.random(), float(np.random.rand())]


def test_rng_restored_at_the_same_world_rederived_at_another():
    et.seed_all(5)
    saved = et.capture_rng(seed=11)
    want = _draws()
    assert et.restore_rng(saved, step=7, rank=0, world_size=1) == RESTORED
    assert _draws() == want, "the same numbers again after a restore"
    assert et.restore_rng(saved, step=7, rank=1, world_size=2) == REDERIVED
    derived = _draws()
    assert derived != want
    et.restore_rng(saved, step=7, rank=1, world_size=2)
    assert _draws() == derived, "re-derived deterministically from (seed, step, rank)"
    et.restore_rng(saved, step=7, rank=0, world_size=2)
    assert _draws() != derived, "each rank its own stream"
    with pytest.raises(Exception, match="RNG state is malformed"):
        et.restore_rng({"ranks": [{"torch": "!!"}], "world_size": 1, "seed": 1}, step=0, rank=0, world_size=1)


def test_launcher_flags_change_what_workers_do(tmp_path):
    """elasticrun --lr-scaling sqrt --redistribution full: the example's workers use them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "elasticrun", "--standalone", "--nproc-per-node", "2", "--lr-scaling", "sqrt",
         "--redistribution", "full", "--global-batch-size", "0", str(REPO / "examples" / "train.py"),
         "--steps", "2", "--no-checkpoint", "--dataset-size", "256"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    m = re.search(r"start: .* lr (\S+) global_batch (\d+) accumulation (\d+) redistribution (\w+)", out)
    assert m, out[-2000:]
    assert float(m[1]) == pytest.approx(0.05 * 2 ** 0.5, rel=1e-3), "sqrt scaling at world 2 (linear: 0.1)"
    assert m[4] == "full"


def test_global_batch_that_does_not_divide_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", ELASTICRUN_GLOBAL_BATCH_SIZE="50")
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "train.py"), "--no-checkpoint", "--steps", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("train.py: error: global batch 50 is not a multiple of world size 1 x micro batch "
                                   "32 = 32: use a micro batch of 25, or a global batch of 32 or 64")
