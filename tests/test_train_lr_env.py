"""LR scaling, gradient accumulation and the worker environment (ElasticState)."""

from __future__ import annotations

import json
import math

import pytest

from elasticrun.errors import ConfigError
from elasticrun.job.hints import AdaptationStrategy
from elasticrun.rendezvous.records import RescaleEvent, RescaleType
from elasticrun.train import ElasticState, accumulation_steps, micro_batch_for, parse_strategy, scale_lr


@pytest.mark.parametrize(
    "strategy,expected",
    [("linear", 0.05), (AdaptationStrategy.LINEAR, 0.05), ("sqrt", 0.1 * math.sqrt(0.5)),
     ("SquareRoot", 0.1 * math.sqrt(0.5)), ("none", 0.1), (None, 0.1)],
)
def test_scale_lr_from_4_to_2(strategy, expected):
    assert scale_lr(0.1, 4, 2, strategy) == pytest.approx(expected)


def test_scale_lr_round_trip_and_errors():
    assert scale_lr(scale_lr(0.3, 3, 7, "linear"), 7, 3, "linear") == pytest.approx(0.3)
    assert scale_lr(0.3, 3, 3, "sqrt") == pytest.approx(0.3)
    with pytest.raises(ConfigError, match="world sizes must be at least 1"):
        scale_lr(0.1, 0, 2, "linear")
    with pytest.raises(ConfigError, match="unknown LR adaptation strategy 'cubic'"):
        scale_lr(0.1, 1, 2, "cubic")
    with pytest.raises(ConfigError, match="finite"):
        scale_lr(float("nan"), 1, 2, "linear")
    assert parse_strategy("square_root") is AdaptationStrategy.SQUARE_ROOT


def test_accumulation_keeps_global_batch():
    for world in (1, 2, 4, 8):
        steps = accumulation_steps(64, 8, world)
        assert steps * 8 * world == 64
    assert micro_batch_for(64, 4, 2) == 8


def test_accumulation_errors_say_what_works():
    with pytest.raises(ConfigError, match=r"not a multiple of world size 3 x micro batch 8 = 24.*micro batch of 5"):
        accumulation_steps(60, 8, 3)  # 60 = 3 x 5 x 4
    with pytest.raises(ConfigError, match="smaller than one step"):
        accumulation_steps(16, 8, 4)
    with pytest.raises(ConfigError, match="micro batch of 3"):
        accumulation_steps(30, 4, 5)  # 30 = 5 x 3 x 2
    with pytest.raises(ConfigError, match="lower the micro batch to at most 2"):
        accumulation_steps(10, 4, 5)
    with pytest.raises(ConfigError, match="cannot be split evenly"):
        micro_batch_for(10, 3)


def test_accumulation_divides_48():
    assert accumulation_steps(48, 8, 3) == 2


def test_state_without_launcher_is_world_1():
    s = ElasticState.from_env({})
    assert (s.rank, s.world_size, s.local_rank, s.round, s.prev_world_size) == (0, 1, 0, 0, 0)
    assert s.rescale_type is RescaleType.START and not s.launched and not s.elastic and not s.world_changed


def test_state_under_torchrun_restart():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "abc"}
    s = ElasticState.from_env(env)
    assert s.launched and not s.elastic
    assert s.round == 2 and s.rescale_type is RescaleType.RESTART and s.rdzv_id == "abc"


def test_virtual_local_ranks_keep_the_nodes_first_worker():
    """--virtual-local-rank: LOCAL_RANK is 0 everywhere (the device); ELASTICRUN_LOCAL_RANK says who is first."""
    base = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    second = ElasticState.from_env({**base, "ELASTICRUN_LOCAL_RANK": "1"})
    assert second.local_rank == 0 and not second.is_local_rank0
    assert ElasticState.from_env({**base, "ELASTICRUN_LOCAL_RANK": "0"}).is_local_rank0
    assert ElasticState.from_env(base).is_local_rank0, "under torchrun: LOCAL_RANK decides"
    assert not ElasticState.from_env({**base, "LOCAL_RANK": "1"}).is_local_rank0


def test_state_under_elasticrun_with_event_file(tmp_path):
    ev = RescaleEvent(type=RescaleType.SCALE_DOWN, round=3, old_members=["a", "b"], new_members=["a"],
                      old_world_size=4, new_world_size=2, reason="node b lost its lease")
    path = tmp_path / "event.json"
    path.write_text(json.dumps(ev.to_dict()))
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
           "ELASTICRUN_ROUND": "3", "ELASTICRUN_PREV_WORLD_SIZE": "4", "ELASTICRUN_RESCALE_TYPE": "ScaleDown",
           "ELASTICRUN_RESCALE_EVENT_FILE": str(path), "ELASTICRUN_RDZV_ENDPOINT": "127.0.0.1:2379",
           "ELASTICRUN_RDZV_ID": "job1", "ELASTICRUN_NODE_ID": "a@h:1", "TORCHELASTIC_RESTART_COUNT": "0"}
    s = ElasticState.from_env(env)
    assert s.elastic and s.round == 3 and s.prev_world_size == 4 and s.world_changed
    assert s.rescale_type is RescaleType.SCALE_DOWN
    assert s.event is not None and s.event.removed == ["b"] and s.event.reason.startswith("node b")
    assert s.progress_id == "a@h:1" and s.rdzv_id == "job1"
    assert "ScaleDown world 4->2" in s.describe()
    # prev world size comes from the event file if the variable is missing
    env2 = dict(env, ELASTICRUN_PREV_WORLD_SIZE="", ELASTICRUN_RESCALE_TYPE="")
    assert ElasticState.from_env(env2).prev_world_size == 4


def test_state_tolerates_a_broken_event_file(tmp_path, caplog):
    path = tmp_path / "event.json"
    path.write_text("{not json")
    s = ElasticState.from_env({"ELASTICRUN_ROUND": "1", "ELASTICRUN_RESCALE_TYPE": "Restart",
                               "ELASTICRUN_RESCALE_EVENT_FILE": str(path)})
    assert s.event is None and s.rescale_type is RescaleType.RESTART
    assert "ignoring rescale event file" in caplog.text


def test_first_round_event_file_is_empty_and_quiet(tmp_path, caplog):
    path = tmp_path / "event.json"
    path.write_text("{}")  # what the agent writes for a round without a rescale event
    s = ElasticState.from_env({"ELASTICRUN_ROUND": "0", "ELASTICRUN_RESCALE_EVENT_FILE": str(path)})
    assert s.event is None and s.rescale_type is RescaleType.START
    assert "ignoring rescale event file" not in caplog.text


def test_state_rejects_bad_values():
    with pytest.raises(ConfigError, match="RANK='x' is not an integer"):
        ElasticState.from_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="RANK=2 is outside 0..1"):
        ElasticState.from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="is not one of Start"):
        ElasticState.from_env({"ELASTICRUN_RESCALE_TYPE": "Grow"})
