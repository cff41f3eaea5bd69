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


@pytest.mark.parametrize("hang_timeout, dumped", [(10.0, True), (0.0, False)])
def test_a_failed_reform_dumps_the_stacks_before_the_kill_when_workers_answer_the_signal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hang_timeout: float, dumped: bool) -> None:
    """With --hang-timeout the workers registered the stack signal: their stacks reach the log before they are
    killed (where each stood instead of re-forming); without it the signal would kill them, so none is sent."""
    import elasticrun.launch.inplace as mod

    calls: list = []
    monkeypatch.setattr(mod, "dump_stacks", lambda workers: calls.append(("dump", len(workers))))
    monkeypatch.setattr(mod, "stop_workers", lambda rdzv, workers, grace, sig=None: calls.append(("stop", sig)))
    said: list = []
    rounds = _rounds(tmp_path)
    rounds.cfg = SimpleNamespace(rendezvous=rounds.cfg.rendezvous, health=SimpleNamespace(hang_timeout=hang_timeout))
    rounds.say = said.append
    for i, w in enumerate(rounds.workers.running):
        w.spec.member = SimpleNamespace(node_id="n1", host="h")
        w.spec.rank, w.spec.error_file = i, str(tmp_path / f"err{i}")
    rdzv = SimpleNamespace(beat=lambda busy_for=0.0: calls.append(("beat", busy_for)),
                           report_failure=lambda topo, rows: calls.append(("report", len(rows))))
    rounds.give_up(rdzv, SimpleNamespace(round=4), "workers did not re-form within 60 s")
    kinds = [c[0] for c in calls]
    assert kinds == (["beat", "dump", "report", "stop"] if dumped else ["report", "stop"]), calls
    assert ("dump", 2) in calls if dumped else True
    assert ("stacks" in said[0]) is dumped and "workers did not re-form within 60 s" in said[0], said
