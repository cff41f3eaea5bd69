"""InPlace refuses registered state that holds sharded tensors (its re-form sends rank 0's state to all)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from elasticrun.errors import ConfigError
from elasticrun.train.inplace import InPlace


@pytest.fixture
def one_rank_group(tmp_path, monkeypatch):
    """A real single-process gloo group (DTensors need one), destroyed after the test."""
    monkeypatch.delenv("ELASTICRUN_INPLACE_FILE", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_a_sharded_tensor_anywhere_in_a_registered_state_is_refused(one_rank_group):
    ctx = SimpleNamespace()
    shard = distribute_tensor(torch.ones(4, 2), one_rank_group, [Shard(0)])
    holder = SimpleNamespace(state_dict=lambda: {"layers": [{"w": torch.zeros(1)}, {"w": shard}]})
    with pytest.raises(ConfigError, match=r"model's state holds a sharded tensor at layers\.1\.w \(DTensor\)"):
        InPlace(ctx, model=holder)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert InPlace(ctx, model=model, optimizer=opt).objects["model"] is model, "replicated state is accepted"
