"""Every ``elasticrun run`` option lands in the LaunchConfig fields its table entry names (no processes).

The option table (elasticrun.cli.run_options) says, for each option, which config fields it
fills. These tests walk the whole table: each option's fields exist, every config field is
filled by some option (or is a positional one), and setting each option on the command line
changes exactly the fields it names, so an option added without its field, or a field that a
rule forgets to fill, fails here rather than being dropped silently.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Set, Tuple

import pytest

from elasticrun.cli.run_config import build_config
from elasticrun.cli.run_options import INTERNAL_FIELDS, POSITIONAL_FIELDS, Kind, Opt, Type, all_options
from elasticrun.cli.torchrun_args import Parser
from elasticrun.launch.config import GROUPS, LaunchConfig

BASE = ["--node-id", "n0", "--rdzv-endpoint", "etcd-host:2379"]  # an external etcd: a fixed id and rendezvous
STATIC = ["--node-id", "n0", "--nnodes", "2"]  # torchrun's static rendezvous: node rank 0 hosts the etcd
CHECKED_ONLY = {"logs_specs"}  # accepted and checked (only torchrun's default), no field to fill

# dest → (base arguments, the option's arguments), for the options whose sample :func:`_sample`
# cannot make up: text values, and values that only mean something with another option.
SAMPLES: Dict[str, Tuple[List[str], List[str]]] = {
    "nnodes": (BASE, ["--nnodes", "1:3"]),
    "nproc_per_node": (BASE, ["--nproc-per-node", "cpu"]),
    "rdzv_backend": (BASE, ["--rdzv-backend", "c10d"]),
    "rdzv_endpoint": (BASE, ["--rdzv-endpoint", "h1:2379,h2:2379"]),
    "rdzv_id": (BASE, ["--rdzv-id", "job42"]),
    "rdzv_conf": (BASE, ["--rdzv-conf", "join_timeout=7,last_call_timeout=2,close_timeout=9,read_timeout=4,"
                         "is_host=1,rank=0,cacert=/ca,cert=/c,key=/k,rescale_timeout=8,etcd_members=1,"
                         "heartbeat_timeout=3"]),
    "event_log_handler": (BASE, ["--event-log-handler", " console "]),
    "role": (BASE, ["--role", "trainer"]),
    "run_path": ([*BASE, "-m"], ["--run-path"]),
    "log_dir": (BASE, ["--log-dir", "/tmp/logs"]),
    "redirects": (BASE, ["--redirects", "3"]),
    "tee": (BASE, ["--tee", "0:1,1:2"]),
    "local_ranks_filter": (BASE, ["--local-ranks-filter", "2,0"]),
    "duplicate_stdout_filters": (BASE, ["--duplicate-stdout-filters", "a,,b"]),
    "duplicate_stderr_filters": (BASE, ["--duplicate-stderr-filters", "loss"]),
    "node_rank": (BASE, ["--node-rank", "0"]),
    "master_addr": (STATIC, ["--master-addr", "10.0.0.1"]),
    "master_port": (STATIC, ["--master-port", "29555"]),
    "local_addr": (BASE, ["--local-addr", "10.0.0.9"]),
    "logs_specs": (BASE, ["--logs-specs", "default"]),
    "signals_to_handle": (BASE, ["--signals-to-handle", "sigterm,SIGUSR1"]),
    "node_id": (BASE, ["--node-id", "n1"]),
    "backend": (BASE, ["--backend", "gloo"]),
    "restart_window": (BASE, ["--restart-window", "1h"]),
    "snapshot_memory": (BASE, ["--snapshot-memory", "8GiB"]),
    "node_check_thresholds": (BASE, ["--node-check-thresholds", "min-cpu-gflops=20"]),
    "metrics_host": (BASE, ["--metrics-host", "0.0.0.0"]),
    "events_file": (BASE, ["--events-file", "/tmp/events.jsonl"]),
    "etcd_binary": (BASE, ["--etcd-binary", "/opt/etcd"]),
    "ended_job_ttl": (BASE, ["--ended-job-ttl", "1h"]),
    "etcd_user": (BASE, ["--etcd-user", "trainer"]),
    "etcd_password": (BASE, ["--etcd-password", "secret"]),
    "etcd_password_file": (BASE, ["--etcd-password-file", "/run/secrets/etcd"]),
    "etcd_cacert": (BASE, ["--etcd-cacert", "/ca.pem"]),
    "etcd_cert": (BASE, ["--etcd-cert", "/cert.pem"]),
    "etcd_key": (BASE, ["--etcd-key", "/key.pem"]),
}


def _sample(opt: Opt) -> Tuple[List[str], List[str]]:
    """(base, option arguments) that give ``opt`` a value other than its default."""
    if opt.dest in SAMPLES:
        return SAMPLES[opt.dest]
    if opt.kind is Kind.FLAG:
        return BASE, [opt.negative[0] if opt.default else opt.long]
    if opt.choices:
        return BASE, [opt.long, next(c for c in opt.choices if c != opt.default)]
    if opt.type is Type.INT:
        return BASE, [opt.long, str((opt.default or 0) + 1)]
    if opt.type is Type.FLOAT:
        return BASE, [opt.long, str((opt.default or 0.0) + 1.5)]
    raise AssertionError(f"{opt.long}: add a sample value to SAMPLES")


def _config(argv: List[str]) -> LaunchConfig:
    return build_config(Parser().parse([*argv, "train.py", "--epochs", "3"], {}))


def _values(cfg: LaunchConfig) -> Dict[str, Any]:
    return cfg.paths()


def _field_names() -> Set[str]:
    """Every field of LaunchConfig's groups, as ``group.field``."""
    return {f"{group}.{f.name}" for group, kind in GROUPS.items() for f in dataclasses.fields(kind)}


@pytest.mark.parametrize("opt", all_options(), ids=lambda o: o.long)
def test_every_option_names_config_fields(opt: Opt) -> None:
    unknown = set(opt.fills) - _field_names()
    assert not unknown, f"{opt.long} fills {sorted(unknown)}, which LaunchConfig does not have"
    if not opt.fills:
        assert opt.dest in CHECKED_ONLY, f"{opt.long} fills no LaunchConfig field: name its field in `fills`"
    elif not opt.joint:
        assert len(opt.fills) == 1, f"{opt.long}: a plain option fills one field; mark it joint to fill more"


def test_every_config_field_is_filled_by_an_option_or_documented() -> None:
    filled = {name for opt in all_options() for name in opt.fills} | set(POSITIONAL_FIELDS) | set(INTERNAL_FIELDS)
    assert _field_names() - filled == set(), "no option fills these fields: name them in an option's `fills`"
    assert filled - _field_names() == set()


@pytest.mark.parametrize("opt", all_options(), ids=lambda o: o.long)
def test_every_option_changes_exactly_the_fields_it_names(opt: Opt) -> None:
    base, argv = _sample(opt)
    before, after = _values(_config(base)), _values(_config([*base, *argv]))
    changed = {name for name in before if before[name] != after[name]}
    if opt.dest in CHECKED_ONLY:
        assert changed == set()
        return
    assert changed, f"{' '.join(argv)} changed no field of LaunchConfig (it should fill {opt.fills})"
    assert changed <= set(opt.fills), f"{' '.join(argv)} changed {sorted(changed - set(opt.fills))} too"
    if not opt.joint:
        assert changed == set(opt.fills)


def test_rdzv_conf_keys_fill_every_field_they_name() -> None:
    """One ``--rdzv-conf`` with a key for each field: every field of the key table changes."""
    opt = next(o for o in all_options() if o.dest == "rdzv_conf")
    base, argv = SAMPLES["rdzv_conf"]
    before, after = _values(_config(base)), _values(_config([*base, *argv]))
    assert {name for name in before if before[name] != after[name]} == set(opt.fills)


def test_the_positional_arguments_fill_the_script_fields() -> None:
    cfg = _config(BASE)
    assert (cfg.workers.entrypoint, cfg.workers.args) == ("train.py", ["--epochs", "3"])


def test_the_groups_are_exactly_launch_configs_fields() -> None:
    assert list(GROUPS) == [f.name for f in dataclasses.fields(LaunchConfig)]
    assert set(LaunchConfig().paths()) == _field_names()


def test_of_builds_the_groups_and_refuses_a_field_it_does_not_have() -> None:
    cfg = LaunchConfig.of({"workers.entrypoint": "t.py", "rendezvous.heartbeat_timeout": 9.0})
    assert (cfg.workers.entrypoint, cfg.rendezvous.heartbeat_timeout) == ("t.py", 9.0)
    with pytest.raises(TypeError):
        LaunchConfig.of({"workers.no_such_field": 1})
    with pytest.raises(TypeError):
        LaunchConfig.of({"heartbeat_timeout": 9.0})


@pytest.mark.parametrize("flag, key, path, want", [
    (["--join-timeout", "7"], "join_timeout=5", "rendezvous.join_timeout", 7.0),
    (["--heartbeat-timeout", "9"], "keep_alive_interval=2,keep_alive_max_attempt=2", "rendezvous.heartbeat_timeout",
     9.0),
    (["--etcd-timeout", "3"], "read_timeout=4", "etcd.etcd_timeout", 3.0),
    (["--etcd-cacert", "/flag.pem"], "cacert=/key.pem", "etcd.etcd_cacert", "/flag.pem"),
    (["--node-rank", "0"], "rank=1", "rendezvous.node_rank", 0),
    ([], "join_timeout=5", "rendezvous.join_timeout", 5.0),
])
def test_a_dedicated_flag_beats_the_rdzv_conf_key_for_its_field(flag: List[str], key: str, path: str,
                                                                 want: Any) -> None:
    cfg = _config([*BASE, "--nnodes", "1:2", *flag, "--rdzv-conf", key])
    assert cfg.paths()[path] == want
