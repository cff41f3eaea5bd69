"""Whether the fork server imports torch before the first round's workers (elasticrun.launch.preload)."""

from __future__ import annotations

import pytest

from elasticrun.errors import ConfigError
from elasticrun.job import env as names
from elasticrun.launch.preload import preload_first, usable_cores


@pytest.mark.parametrize("nproc, cores, want", [
    (1, 2, True),  # the worker's import and the store host's would share the agent's two cores
    (2, 2, True),
    (1, 3, False),  # a core each for the worker, the store host and the agent: side by side is no slower
    (8, 16, False),  # an 8-GPU host with 16 cores: the bare server, as torchrun's workers start
    (8, 8, True),
])
def test_auto_preloads_first_where_cores_are_fewer_than_workers_plus_two(nproc: int, cores: int, want: bool) -> None:
    for value in (None, "auto", "AUTO", ""):
        env = {} if value is None else {names.PRELOAD_FIRST: value}
        assert preload_first(nproc, env, cores) is want


def test_the_variable_forces_either_way() -> None:
    assert preload_first(8, {names.PRELOAD_FIRST: "1"}, 64) is True
    assert preload_first(1, {names.PRELOAD_FIRST: "0"}, 1) is False
    assert preload_first(1, {names.PRELOAD_FIRST: " 1 "}, 64) is True


@pytest.mark.parametrize("value", ["yes", "2", "true", "first"])
def test_another_value_is_one_clear_error(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        preload_first(1, {names.PRELOAD_FIRST: value}, 2)
    assert str(err.value) == f"{names.PRELOAD_FIRST}={value!r}: use 1, 0 or auto"


def test_usable_cores_counts_this_process_affinity() -> None:
    assert 1 <= usable_cores() <= 4096


def test_a_forked_worker_marks_its_first_use_of_ddps_extras_and_steps_aside(tmp_path, monkeypatch) -> None:
    from elasticrun.launch.warm import _DeepUse

    marker = tmp_path / "deep-imports"
    finder = _DeepUse(str(marker))
    monkeypatch.setattr("sys.meta_path", [finder])
    assert finder.find_spec("json") is None and not marker.exists(), "other imports go on unmarked"
    assert finder.find_spec("torch._dynamo") is None, "it finds nothing: the import goes on unchanged"
    assert marker.exists(), "the agent learns the script uses DDP's extras"
    import sys

    assert finder not in sys.meta_path, "then it steps aside"
