"""LaunchConfig.validate: one line per bad value, naming the flag (elasticrun.launch.config)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from elasticrun.errors import ConfigError
from elasticrun.launch.config import LaunchConfig, RendezvousConfig, WorkersConfig


@pytest.fixture
def good(tmp_path: Path) -> LaunchConfig:
    script = tmp_path / "train.py"
    script.write_text("")
    return LaunchConfig(rendezvous=RendezvousConfig(rdzv_endpoint="127.0.0.1:2379"),
                        workers=WorkersConfig(entrypoint=str(script)))


@pytest.mark.parametrize("field, value, message", [
    ("rendezvous.nnodes_min", 0, "--nnodes 0:1: need 1 <= MIN <= MAX"),
    ("workers.nproc_per_node", 0, "--nproc-per-node 0: need at least 1 worker per node"),
    ("rendezvous.rdzv_id", "a b", "--rdzv-id 'a b': use letters, digits, '_', '.', '-' (at most 128 characters)"),
    ("rendezvous.node_id", "a/b", "--node-id 'a/b': use letters, digits and _ . @ : - only"),
    ("workers.standby", -1, "--standby -1: must be 0 or more (0 turns standby interpreters off)"),
    ("rendezvous.max_restarts", -1, "--max-restarts -1: must be 0 or more"),
    ("workers.global_batch_size", -1, "--global-batch-size -1: must be 0 (none) or more"),
    ("logs.metrics_port", 65536, "--metrics-port 65536: not a port; use 1-65535, or 0 for no metrics"),
    ("rendezvous.restart_window", -1.0, "--restart-window -1.0: must not be negative (0: the whole job)"),
    ("health.hang_timeout", -1.0, "--hang-timeout -1.0: must not be negative (0 turns it off)"),
    ("etcd.etcd_outage_grace", -1.0, "--etcd-outage-grace -1.0: must not be negative"),
    ("rendezvous.heartbeat_timeout", 1.5, "--heartbeat-timeout 1.5: etcd leases need at least 2 seconds"),
    ("rendezvous.inplace_ready_timeout", 0.0, "--inplace-ready-timeout 0.0: must be more than 0 seconds"),
    ("etcd.etcd_timeout", 0.0, "--etcd-timeout 0.0: must be more than 0 seconds"),
    ("rendezvous.stability_window", -1.0, "--stability-window must not be negative"),
    ("workers.shutdown_timeout", -1.0, "--shutdown-timeout must not be negative"),
    ("rendezvous.join_timeout", math.inf, "--join-timeout inf: must be a finite number of seconds"),
    ("health.hang_timeout", -math.inf, "--hang-timeout -inf: must be a finite number of seconds"),
    ("rendezvous.node_rank", 1, "--node-rank 1: must be 0 .. 0 with --nnodes 1:1"),
    ("logs.local_ranks_filter", [-1], "--local-ranks-filter: local rank -1 must not be negative"),
    ("workers.signals_to_handle", ["SIGKILL"], "--signals-to-handle: SIGKILL cannot be handled; remove it"),
    ("workers.entrypoint", "", "no training script given"),
    ("rendezvous.rdzv_endpoint", "", "no rendezvous: pass --rdzv-endpoint host:port"),
    ("logs.tee", "9", "--tee '9': use 0 (none), 1 (stdout), 2 (stderr), 3 (both)"),
])
def test_each_bad_value_is_one_line_naming_its_flag(good: LaunchConfig, field: str, value: object,
                                                    message: str) -> None:
    group, _, name = field.partition(".")
    setattr(getattr(good, group), name, value)
    with pytest.raises(ConfigError) as err:
        good.validate()
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_a_good_config_validates_to_itself(good: LaunchConfig) -> None:
    assert good.validate() is good


def test_the_first_bad_value_speaks(good: LaunchConfig) -> None:
    good.workers.nproc_per_node = 0
    good.rendezvous.max_restarts = -1
    with pytest.raises(ConfigError, match="--nproc-per-node"):
        good.validate()
