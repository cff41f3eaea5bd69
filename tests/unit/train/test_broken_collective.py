"""InPlace.recover waits for a recovery only for a collective a peer broke; a bug in the step raises at once."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from elasticrun.train.inplace import broken_collective

GLOO_PEER_GONE = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                  "[127.0.0.1]:22930. This is typically caused by a remote worker crashing.")


@pytest.mark.parametrize("err", [RuntimeError(GLOO_PEER_GONE), dist.DistBackendError("NCCL error"),
                                 dist.DistNetworkError("store"), RuntimeError("Connection reset by peer")])
def test_a_collective_broken_by_a_peer_is_recoverable(err: BaseException) -> None:
    assert broken_collective(err)


def test_a_bug_in_the_step_is_not() -> None:
    with pytest.raises(RuntimeError) as bug:
        torch.ones(2, 3) @ torch.ones(2, 3)
    assert not broken_collective(bug.value)
    assert not broken_collective(ValueError(GLOO_PEER_GONE)), "only RuntimeErrors and torch.distributed errors"
    assert not broken_collective(KeyboardInterrupt())
