"""The commit fence as the writer calls it (elasticrun.checkpoint.fence): installed from above,
called right before a save becomes visible, refusing when a fenced worker has none."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Iterator, List

import pytest

from elasticrun.checkpoint import fence
from elasticrun.checkpoint.commit import commit
from elasticrun.checkpoint.storage import get_storage
from elasticrun.errors import CheckpointError
from elasticrun.job import env as names


@pytest.fixture(autouse=True)
def no_fence() -> Iterator[None]:
    previous = fence.install(None)
    yield
    fence.install(previous)


@pytest.fixture
def fenced_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {names.ROUND: "2", names.RDZV_ID: "j", names.RDZV_ENDPOINT: "127.0.0.1:1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(names.ETCD_SETTINGS_FILE, raising=False)


def test_outside_elasticrun_there_is_nothing_to_check(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(names.ROUND, raising=False)
    fence.check()


def test_a_fenced_worker_without_a_fence_cannot_confirm_its_round(fenced_worker):
    with pytest.raises(CheckpointError, match="cannot confirm that round 2 is still current .*import elasticrun.train"):
        fence.check()


def test_the_installed_fence_is_called_and_its_refusal_stops_the_commit(fenced_worker, tmp_path: Path):
    calls: List[str] = []

    def refuse() -> None:
        calls.append("called")
        raise CheckpointError("a stale round must not commit a checkpoint")

    assert fence.install(refuse) is None
    storage = get_storage(str(tmp_path))
    tmp = storage.join(".a.tmp-x")
    storage.mkdirs(tmp)
    with pytest.raises(CheckpointError, match="a stale round must not commit"):
        commit(storage, tmp, storage.join("a"), b"{}", 0)
    assert calls == ["called"] and not storage.exists(storage.join("a")), "nothing published"
    assert fence.install(lambda: None) is refuse
    commit(storage, tmp, storage.join("a"), b"{}", 0)
    assert storage.exists(storage.join("a", "metadata.json"))


def test_importing_elasticrun_train_installs_the_etcd_fence():
    import elasticrun.train
    from elasticrun.train.fence import check_round_is_current

    fence.install(None)
    importlib.reload(elasticrun.train)  # the package's import, again
    assert fence.install(None) is check_round_is_current
