"""checkpoint.storage: Storage is an abstract base; register_storage takes a factory or an instance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elasticrun.checkpoint import storage as storage_mod
from elasticrun.checkpoint.storage import LocalStorage, Storage, get_storage, register_storage


@pytest.fixture(autouse=True)
def clean_registry():
    saved = dict(storage_mod._REGISTRY)
    yield
    storage_mod._REGISTRY.clear()
    storage_mod._REGISTRY.update(saved)


def test_storage_is_abstract():
    class Half(Storage):
        def exists(self, path: str) -> bool:
            return False

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_an_instance_or_a_factory_serves_a_scheme(tmp_path: Path):
    mine = LocalStorage(str(tmp_path / "a"))
    register_storage("mine", mine)
    assert get_storage("mine://anything") is mine
    assert get_storage(mine) is mine, "a ready instance is used as is"
    seen = []

    def factory(root, options):
        seen.append((root, options))
        return LocalStorage(str(tmp_path / "b"))

    register_storage("made", factory)
    made = get_storage("made://bucket/ckpts", {"token": "t"})
    assert isinstance(made, LocalStorage) and seen == [("made://bucket/ckpts", {"token": "t"})]
    with pytest.raises(TypeError):
        register_storage("bad", 42)  # type: ignore[arg-type]


def test_save_and_load_through_a_registered_scheme(tmp_path: Path):
    from elasticrun.checkpoint import load, save

    register_storage("vault", lambda root, options: LocalStorage(str(tmp_path / root.split("://", 1)[1])))
    assert save({"w": torch.arange(4.0)}, "vault://ckpts", "one") == "one"
    assert (tmp_path / "ckpts" / "one").is_dir()
    assert torch.equal(load("vault://ckpts", "one").state_dict["w"], torch.arange(4.0))
