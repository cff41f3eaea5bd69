"""What an agent tells the workers it keeps through a round's end (launch/inplace.py: InPlaceRounds.carry):
every kept worker gets the recovery word; only a crash or a lost node says the collectives broke."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from elasticrun.job.inplace import INPLACE_DEADLINE_S, collectives_broken, recovery_announced
from elasticrun.launch.inplace import InPlaceRounds


def _rounds(tmp_path: Path, nproc: int = 2) -> InPlaceRounds:
    cfg = SimpleNamespace(rendezvous=SimpleNamespace(inplace=True, inplace_ready_timeout=30.0))
    workers = SimpleNamespace(running=[SimpleNamespace(spec=SimpleNamespace(local_rank=i)) for i in range(nproc)],
                              inplace_file=lambda i: str(tmp_path / f"w{i}"))
    return InPlaceRounds(cfg, workers, say=lambda msg: None)


@pytest.mark.parametrize("failed, broken, told", [(False, False, False), (True, False, True), (False, True, True)])
def test_kept_workers_hear_whether_the_round_broke(tmp_path: Path, failed: bool, broken: bool, told: bool) -> None:
    rounds = _rounds(tmp_path)
    rounds.carry(5, failed=failed, broken=broken)
    assert rounds.carrying
    for i in range(2):
        f = str(tmp_path / f"w{i}")
        assert recovery_announced(f, 5) == 30.0 + INPLACE_DEADLINE_S
        assert collectives_broken(f, 5) is told
