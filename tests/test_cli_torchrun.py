"""Every torchrun 2.13 flag and PET_* variable through ``elasticrun run``'s parser (no processes).

The table below has a row per torchrun flag; each row runs with every spelling of the flag
and with its ``PET_*`` variable instead, and checks the resulting LaunchConfig. A test also
checks the table against torchrun's own parser, so a flag torchrun adds cannot go unnoticed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest

from elasticrun.cli.run_config import build_config
from elasticrun.cli.run_options import TORCHRUN_OPTIONS, Kind, Opt
from elasticrun.cli.torchrun_args import Parser
from elasticrun.errors import ConfigError
from elasticrun.launch.config import LaunchConfig, RdzvBackend
from elasticrun.rendezvous.ranks import place_fixed_ranks, plan_members
from elasticrun.rendezvous.records import NodeInfo

from helpers.launch import ECHO, assert_one_line_error, run_cli

ETCD = ["--rdzv-endpoint", "etcd-host:2379"]  # an external etcd: the rendezvous flags stay out of the way
Check = Callable[[LaunchConfig], None]


def expect(**fields: Any) -> Check:
    """A check of the named fields (by their names inside LaunchConfig's groups)."""

    def check(cfg: LaunchConfig) -> None:
        by_name = {path.partition(".")[2]: value for path, value in cfg.paths().items()}
        got = {k: by_name[k] for k in fields}
        assert got == fields

    return check


# dest → (value on the command line / in PET_*, extra args, the check, or an error substring)
ROWS: Dict[str, Tuple[Optional[str], List[str], Any]] = {
    "nnodes": ("1:3", ETCD, expect(nnodes_min=1, nnodes_max=3)),
    "nproc_per_node": ("3", [], expect(nproc_per_node=3, standalone=True)),
    "rdzv_backend": ("c10d", ["--rdzv-endpoint", "10.0.0.1:29401"],
                     expect(rdzv_backend=RdzvBackend.C10D, rdzv_endpoint="10.0.0.1:29401", standalone=False)),
    "rdzv_endpoint": ("h1:2379,h2:2379", [], expect(rdzv_backend=RdzvBackend.ETCD, rdzv_endpoint="h1:2379,h2:2379")),
    "rdzv_id": ("job42", ETCD, expect(rdzv_id="job42")),
    "rdzv_conf": ("join_timeout=7,last_call_timeout=2,close_timeout=9,read_timeout=4,keep_alive_interval=2,"
                  "keep_alive_max_attempt=4", ETCD,
                  expect(join_timeout=7.0, stability_window=2.0, rdzv_close_timeout=9.0, etcd_timeout=4.0,
                         heartbeat_timeout=8.0)),
    "standalone": (None, ETCD, expect(standalone=True, rdzv_endpoint="")),
    "max_restarts": ("4", ETCD, expect(max_restarts=4)),
    "monitor_interval": ("0.5", ETCD, expect(monitor_interval=0.5)),
    "start_method": ("forkserver", ETCD, expect(start_method="forkserver")),
    "event_log_handler": ("console", ETCD, expect(event_log_handler="console")),
    "role": ("trainer", ETCD, expect(role="trainer")),
    "module": (None, ETCD, expect(module=True, no_python=False)),
    "no_python": (None, ETCD, expect(no_python=True, module=False)),
    "run_path": (None, [*ETCD, "--no-python"], expect(no_python=False, module=False)),
    "log_dir": ("/tmp/logs-x", ETCD, expect(log_dir="/tmp/logs-x")),
    "redirects": ("0:3,1:1", ETCD, expect(redirects="0:3,1:1")),
    "tee": ("2", ETCD, expect(tee="2")),
    "local_ranks_filter": ("2,0", ETCD, expect(local_ranks_filter=[0, 2])),
    "duplicate_stdout_filters": ("apple,orange", ETCD, expect(duplicate_stdout_filters=["apple", "orange"])),
    "duplicate_stderr_filters": ("a,,b,c", ETCD, expect(duplicate_stderr_filters=["a,b", "c"])),
    "node_rank": ("1", [*ETCD, "--nnodes", "2"], expect(node_rank=1, rdzv_backend=RdzvBackend.ETCD)),
    "master_addr": ("10.1.2.3", ["--nnodes", "2"],
                    expect(rdzv_backend=RdzvBackend.STATIC, rdzv_endpoint="10.1.2.3:29500", node_rank=0,
                           rdzv_is_host=True)),
    "master_port": ("29555", ["--nnodes", "2"], expect(rdzv_backend=RdzvBackend.STATIC,
                                                       rdzv_endpoint="127.0.0.1:29555")),
    "local_addr": ("10.0.0.9", ETCD, expect(local_addr="10.0.0.9")),
    "logs_specs": ("default", ETCD, expect(log_dir=None)),
    "numa_binding": ("core-complex", ETCD, expect(numa_binding="core-complex")),
    "signals_to_handle": ("SIGTERM,SIGUSR1", ETCD, expect(signals_to_handle=["SIGTERM", "SIGUSR1"])),
    "shutdown_timeout": ("7", ETCD, expect(shutdown_timeout=7.0)),
    "virtual_local_rank": (None, ETCD, expect(virtual_local_rank=True)),
}


def _config(argv: Sequence[str], env: Optional[Dict[str, str]] = None) -> LaunchConfig:
    parsed = Parser().parse(list(argv), env or {})
    return build_config(parsed)


def _cases() -> List[Any]:
    cases = []
    for opt in TORCHRUN_OPTIONS:
        value, extra, want = ROWS[opt.dest]
        for name in opt.names:
            flag = [name] if opt.kind is Kind.FLAG else [name, value]
            cases.append(pytest.param(opt, [*extra, *flag], {}, want, id=f"{opt.dest}:{name}"))
        if opt.kind is Kind.VALUE and opt.names[-1].startswith("--"):
            cases.append(pytest.param(opt, [*extra, f"{opt.names[-1]}={value}"], {}, want, id=f"{opt.dest}:="))
        env_value = "1" if opt.kind is Kind.FLAG else str(value)
        cases.append(pytest.param(opt, list(extra), {opt.pet: env_value}, want, id=f"{opt.dest}:{opt.pet}"))
    return cases


def test_table_has_a_row_for_every_torchrun_flag_and_matches_torchruns_parser() -> None:
    from torch.distributed.run import get_args_parser

    assert set(ROWS) == {o.dest for o in TORCHRUN_OPTIONS}
    ours = {name: opt for opt in TORCHRUN_OPTIONS for name in opt.names}
    for action in get_args_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        for name in action.option_strings:
            assert name in ours, f"torchrun flag {name} is missing from elasticrun"
            assert ours[name].dest == action.dest, f"{name}: PET_{action.dest.upper()} expected"
        if action.choices:
            assert ours[action.option_strings[0]].choices == tuple(action.choices), action.dest
        default = action.default if action.dest not in ("nnodes",) else "1"
        if action.dest in ("standalone", "module", "no_python", "run_path", "virtual_local_rank"):
            assert ours[action.option_strings[0]].kind is Kind.FLAG
        elif action.dest not in ("rdzv_backend", "rdzv_id", "duplicate_stdout_filters", "duplicate_stderr_filters",
                                 "master_port", "node_rank"):
            # Same default as torchrun (rdzv_backend/rdzv_id/master_port/node_rank: decided later, see docs/cli.md).
            assert ours[action.option_strings[0]].default == default, action.dest


@pytest.mark.parametrize("opt,argv,env,want", _cases())
def test_every_torchrun_flag_and_pet_variable(opt: Opt, argv: List[str], env: Dict[str, str], want: Any) -> None:
    script = ["pkg.train"] if opt.dest == "module" else [ECHO]
    if isinstance(want, str):
        with pytest.raises(ConfigError) as err:
            _config([*argv, *script], env)
        assert want in str(err.value)
        assert (opt.pet in str(err.value)) == bool(env), "the message names where the value came from"
        return
    cfg = _config([*argv, *script], env)
    want(cfg)
    assert cfg.workers.entrypoint == script[0]


def test_defaults_are_torchruns() -> None:
    cfg = _config([ECHO])
    assert (cfg.rendezvous.standalone, cfg.rendezvous.nnodes_min, cfg.rendezvous.nnodes_max,
            cfg.workers.nproc_per_node) == (True, 1, 1, 1)
    assert cfg.rendezvous.max_restarts == 0
    assert cfg.workers.shutdown_timeout == 30.0 and cfg.workers.monitor_interval == 0.1
    assert cfg.workers.signals_to_handle == ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"] and cfg.workers.role == "default"
    assert cfg.logs.redirects == "0" and cfg.logs.tee == "0"
    assert cfg.logs.local_ranks_filter is None and cfg.logs.log_dir is None
    assert _config([ECHO], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "12"}).workers.shutdown_timeout == 12.0
    # torchrun's static default for several nodes: node rank 0 at 127.0.0.1:29500 hosts the rendezvous.
    cfg = _config(["--nnodes", "2", ECHO])
    assert (cfg.rendezvous.rdzv_backend, cfg.rendezvous.rdzv_endpoint, cfg.rendezvous.node_rank,
            cfg.rendezvous.rdzv_is_host) == (
        RdzvBackend.STATIC, "127.0.0.1:29500", 0, True)


def test_flag_beats_pet_variable_which_beats_elasticrun_variable() -> None:
    env = {"PET_NPROC_PER_NODE": "4", "PET_RDZV_ENDPOINT": "pet:1", "ELASTICRUN_RDZV_ENDPOINT": "own:2"}
    cfg = _config(["--nproc-per-node", "2", ECHO], env)
    assert cfg.workers.nproc_per_node == 2 and cfg.rendezvous.rdzv_endpoint == "pet:1"
    assert _config([ECHO], {"ELASTICRUN_RDZV_ENDPOINT": "own:2"}).rendezvous.rdzv_endpoint == "own:2"
    assert _config([*ETCD, ECHO], {"PET_STANDALONE": "0"}).rendezvous.standalone is False
    with pytest.raises(ConfigError, match="PET_STANDALONE='yes': use 1"):
        _config([ECHO], {"PET_STANDALONE": "yes"})
    with pytest.raises(ConfigError, match=r"PET_MAX_RESTARTS='x': expected a whole number"):
        _config([ECHO], {"PET_MAX_RESTARTS": "x"})


def test_kubeflow_pytorchjob_environment_makes_a_static_job() -> None:
    env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-master-0",
           "PET_MASTER_PORT": "23456"}
    cfg = _config([ECHO], env)
    assert (cfg.rendezvous.rdzv_backend, cfg.rendezvous.rdzv_endpoint, cfg.rendezvous.node_rank,
            cfg.rendezvous.rdzv_is_host, cfg.rendezvous.nnodes_min) == (
        RdzvBackend.STATIC, "job-master-0:23456", 1, False, 2)


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2", "etcd-v3", "ETCD"])
def test_etcd_backends_all_mean_the_etcd_v3_rendezvous(backend: str) -> None:
    cfg = _config(["--rdzv-backend", backend, "--rdzv-endpoint", "e:2379", "--nnodes", "1:4", ECHO])
    assert (cfg.rendezvous.rdzv_backend, cfg.rendezvous.rdzv_endpoint, cfg.rendezvous.nnodes_min,
            cfg.rendezvous.nnodes_max) == (RdzvBackend.ETCD, "e:2379", 1, 4)


def test_c10d_endpoint_without_port_gets_torchruns_default_and_is_host_override() -> None:
    cfg = _config(["--rdzv-backend=c10d", "--rdzv-endpoint=node0", "--rdzv-conf=is_host=false", "--nnodes=1:2", ECHO])
    assert (cfg.rendezvous.rdzv_endpoint, cfg.rendezvous.rdzv_is_host, cfg.rendezvous.nnodes_min) == ("node0:29400",
            False, 1)
    cfg = _config(["--rdzv-backend", "static", "--rdzv-endpoint", "n0:1234", "--nnodes", "1:3", "--node-rank", "2",
                   ECHO])
    assert (cfg.rendezvous.rdzv_endpoint, cfg.rendezvous.nnodes_min, cfg.rendezvous.nnodes_max,
            cfg.rendezvous.rdzv_is_host) == ("n0:1234", 3, 3, False)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--rdzv-backend", "zookeeper", ECHO], "unknown backend"),
        (["--rdzv-backend", "c10d", ECHO], "needs --rdzv-endpoint"),
        (["--rdzv-conf", "nosuchkey=1", *ETCD, ECHO], "unknown key 'nosuchkey'"),
        (["--logs-specs", "mine", *ETCD, ECHO], "--logs-specs 'mine': only torchrun's default LogsSpecs"),
        (["--numa-binding", "cores", *ETCD, ECHO], "node, socket, exclusive, core-complex"),
        (["--rdzv-conf", "join_timeout", *ETCD, ECHO], "use key=value"),
        (["--rdzv-conf", "join_timeout=soon", *ETCD, ECHO], "join_timeout='soon'"),
        (["--rdzv-conf", "etcd_prefix=/x", *ETCD, ECHO], "etcd_prefix is not supported"),
        (["--rdzv-conf", "protocol=https", *ETCD, ECHO], "needs cacert"),
        (["--rdzv-conf", "store_type=file", *ETCD, ECHO], "store_type='file'"),
        (["--event-log-handler", "custom", *ETCD, ECHO], "--event-log-handler"),
        (["--local-ranks-filter", "a", *ETCD, ECHO], "comma-separated list of integers"),
        (["--start-method", "thread", *ETCD, ECHO], "spawn, fork, forkserver"),
        (["-m", "--no-python", *ETCD, ECHO], "don't use both"),
        (["--nproc-per-node", "xpu", ECHO], "xpu"),
        (["--foo", ECHO], "unknown option --foo"),
        (["--rdzv-backend"], "needs a value"),
        (["--log-dir", "--nnodes", "2", ECHO], "option --log-dir needs a value"),
        (["--node", "1", ECHO], "ambiguous option --node"),
        (["--standalone=1", ECHO], "takes no value"),
        (["-x", ECHO], "unknown option -x"),
        (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--etcd-cacert", "ca.pem", ECHO], "is plain"),
        (["--nnodes", "2", "--rdzv-conf", "cacert=ca.pem", ECHO], "is plain"),
    ],
)
def test_bad_input_is_one_clear_config_error(argv: List[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(argv)
    assert needle in str(err.value)


def test_validation_of_ranks_and_signals() -> None:
    with pytest.raises(ConfigError, match="--node-rank '2': must be 0 .. 1"):
        _config(["--nnodes", "2", "--node-rank", "2", ECHO])
    with pytest.raises(ConfigError, match="'SIGNOPE' is not a signal name"):
        _config(["--signals-to-handle", "SIGTERM,SIGNOPE", ECHO]).validate()
    with pytest.raises(ConfigError, match="SIGKILL cannot be handled"):
        _config(["--signals-to-handle", "SIGKILL", ECHO]).validate()


def test_script_and_its_arguments_pass_through_untouched() -> None:
    args = ["--nnodes", "5", "--rdzv-backend=c10d", "-h", "--", "-m", "x"]
    cfg = _config(["--nproc_per_node=2", ECHO, *args])
    assert (cfg.workers.entrypoint, cfg.workers.args, cfg.workers.nproc_per_node,
            cfg.rendezvous.nnodes_max) == (ECHO, args, 2, 1)
    # `--` ends the options: the next word is the script even if it looks like an option.
    cfg = _config(["--nproc", "2", "--", "-weird.py", "--x"])
    assert (cfg.workers.entrypoint, cfg.workers.args, cfg.workers.nproc_per_node) == ("-weird.py", ["--x"], 2)
    # short forms as argparse takes them
    cfg = _config(["-r3", "-t=1", "-mq", "pkg.mod", "-r", "0"])
    assert (cfg.logs.redirects, cfg.logs.tee, cfg.workers.module, cfg.logs.quiet, cfg.workers.args) == ("3", "1",
            True, True, ["-r", "0"])
    with pytest.raises(ConfigError, match="--max-restarts '-1'"):  # a negative number is a value (then refused)
        _config(["--max-restarts", "-1", ECHO])


@pytest.mark.parametrize("argv", [["-h"], ["--nnodes", "2", "--help", ECHO], ["--nproc-per-node", "2", "-h"]])
def test_help_anywhere_before_the_script(argv: List[str]) -> None:
    assert Parser().parse(argv, {}).help


@pytest.mark.integration
def test_help_and_unknown_option_on_the_command_line() -> None:
    proc = run_cli(["--nproc-per-node", "2", "-h"], timeout=30, env={"COLUMNS": "160"})
    assert proc.returncode == 0 and "Usage: elasticrun [run]" in proc.stdout and "PET_NPROC_PER_NODE" in proc.stdout
    proc = run_cli(["run", "--rdzv-backnd=c10d", ECHO], timeout=30)
    assert_one_line_error(proc, "unknown option --rdzv-backnd")
    assert proc.returncode == 2
    proc = run_cli(["--nnodes", "2", "--node-rank", "5", ECHO], timeout=30)
    assert_one_line_error(proc, "--node-rank '5'")


def _node(node_id: str, rank: int = -1, joined: float = 0.0) -> Tuple[NodeInfo, int]:
    return NodeInfo(node_id=node_id, host="h", addr="a", nproc=1, pid=1, node_rank=rank, registered_at=joined), 1


def test_planner_keeps_fixed_node_ranks_and_fills_the_gaps() -> None:
    # Joined in order c, b, a; b asked for rank 0, a for rank 2: c fills the free place 1.
    members, spares = plan_members(None, [_node("c", -1, 1), _node("b", 0, 2), _node("a", 2, 3)], 4)
    assert [(m.node_id, m.group_rank) for m in members] == [("b", 0), ("c", 1), ("a", 2)] and spares == []
    # A fixed rank beyond a smaller round's size takes the first free place.
    placed = place_fixed_ranks([_node("x", 3), _node("y", 0)])
    assert [c[0].node_id for c in placed] == ["y", "x"]


def test_docs_have_a_row_for_every_torchrun_flag_and_its_variable() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    table = doc[doc.index("### torchrun's flags"):doc.index("### `--rdzv-conf` keys")]
    rows = [ln for ln in table.splitlines() if ln.startswith("| `-")]
    for opt in TORCHRUN_OPTIONS:
        row = next((r for r in rows if f"`{opt.long}`" in r.split("|")[1]), None)
        assert row is not None, f"docs/cli.md: no row for {opt.long}"
        assert all(f"`{name}`" in row for name in opt.names), f"{opt.long}: every spelling in its row"
        assert f"`{opt.pet}`" in row, f"{opt.long}: its variable {opt.pet} in its row"
    assert len(rows) == len(TORCHRUN_OPTIONS)


def test_a_hosted_etcd_refuses_security_settings_without_echoing_a_password() -> None:
    with pytest.raises(ConfigError) as err:
        _config(["--nnodes", "2", ECHO], {"ELASTICRUN_ETCD_PASSWORD": "s3cret-pw"})
    assert "is plain" in str(err.value) and "ELASTICRUN_ETCD_PASSWORD" in str(err.value)
    assert "s3cret-pw" not in str(err.value)
