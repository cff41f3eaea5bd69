"""Every number, size, duration and port a user can type, given a bad value, on every command.

Each case goes through the real entry point (``elasticrun.cli.main.main``, in-process) and must
end with exit 2, exactly one line on stderr that starts with ``elasticrun: error: <where>``
(the flag, or the variable the value came from: a bad ``PET_NNODES`` is ``PET_NNODES``, not
``--nnodes``), and no traceback. The cases of ``run`` come from its option table, so a new
numeric option is swept without a new line here; the typer commands' numeric options are
found from their signatures and must each have cases below.

Nothing may start: a bad value that slipped through would reach the agent, an etcd server or
an etcd connection, and those are replaced by a failing stand-in for these tests.
"""

from __future__ import annotations

import inspect
import os
import typing
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from elasticrun.cli import main as cli_main
from elasticrun.cli.run_options import Kind, Opt, Type, all_options
from elasticrun.store.server import EtcdServer
from elasticrun.store.settings import EtcdSettings

pytestmark = pytest.mark.integration  # starts etcd or processes

SCRIPT = "train.py"
Case = Tuple[List[str], Dict[str, str], str]  # argv, environment, where the error line must start


def _bad_numbers(opt: Opt) -> List[str]:
    values = ["abc", "1.5x"] if opt.type is Type.INT else ["abc", "nan", "inf"]
    step = 1 if opt.type is Type.INT else 0.5
    if opt.at_least is not None:
        values.append(f"{opt.at_least - step:g}")
    if opt.more_than is not None:
        values.append(f"{opt.more_than:g}")
    if opt.at_most is not None:
        values.append(f"{opt.at_most + step:g}")
    return values


def _sources(opt: Opt, value: str, extra: Tuple[str, ...] = ()) -> Iterator[Case]:
    """The value on the command line, then in each variable the option reads."""
    words = [f"{opt.long}={value}"] if value.startswith("-") else [opt.long, value]  # -5m is no option
    yield [*extra, *words, SCRIPT], {}, opt.long
    for var in ((opt.pet,) if opt.pet else ()) + opt.envvars:
        yield [*extra, SCRIPT], {var: value}, f"{var}={value!r}"


def _opt(dest: str) -> Opt:
    return next(o for o in all_options() if o.dest == dest)


# Options of `run` read from text by their own rules (not INT/FLOAT in the table): dest → bad values.
TEXT_VALUES: Dict[str, List[str]] = {
    "nnodes": ["abc", "0", "-1", "3:2", "1:x"],
    "nproc_per_node": ["abc", "0", "-2", "1.5"],
    "restart_window": ["abc", "-5m", "1x", "nan"],
    "snapshot_memory": ["abc", "-1", "0", "1x"],
    "local_ranks_filter": ["a", "-1", "0,x"],
    "node_check_thresholds": ["cpu=3", "min-cpu-gflops=x", "max-gpu-temp-c=-1", "min-gpu-free-fraction=2"],
    "rdzv_conf": ["join_timeout=nan", "join_timeout=-1", "heartbeat_timeout=abc", "keep_alive_max_attempt=-1",
                  "rescale_timeout=inf"],
}


def _id(case: Case) -> str:
    argv, env, _ = case
    return " ".join(f"{k}={v}" for k, v in env.items()) or " ".join(argv[:-1])


def run_cases() -> Iterator[Tuple[str, Case]]:
    for opt in all_options():
        if opt.kind is Kind.VALUE and opt.type in (Type.INT, Type.FLOAT):
            for value in _bad_numbers(opt):
                for case in _sources(opt, value):
                    yield f"run {_id(case)}", case
    for dest, values in TEXT_VALUES.items():
        for value in values:
            for case in _sources(_opt(dest), value):
                yield f"run {_id(case)}", case
    for value in ("etcd:70000", "etcd:0", "etcd:abc", "etcd:2379,other:99999"):  # an etcd server's endpoints
        for case in _sources(_opt("rdzv_endpoint"), value):
            yield f"run {_id(case)}", case
    for value in ("node0:70000", "node0:abc"):  # the endpoint of a c10d job (hosted by an agent)
        for case in _sources(_opt("rdzv_endpoint"), value, ("--rdzv-backend", "c10d", "--nnodes", "2")):
            yield f"run c10d {_id(case)}", case
    for case in _sources(_opt("node_rank"), "2", ("--nnodes", "2")):  # beyond the node count
        yield f"run {_id(case)} of 2 nodes", case
    for value in ("abc", "-1", "nan"):
        yield f"run TORCH_ELASTIC_SHUTDOWN_TIMEOUT={value}", (
            [SCRIPT], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": value}, f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={value!r}")


ENDPOINT = ["--rdzv-endpoint", "127.0.0.1:1"]
# The typer commands: (command words, flag, bad values, words after the value).
TYPER_VALUES: List[Tuple[List[str], str, List[str], List[str]]] = [
    (["etcd"], "--port", ["abc", "0", "-5", "70000"], []),
    (["etcd"], "--peer-port", ["abc", "-1", "70000"], []),
    (["etcd"], "--auth-token-ttl", ["abc", "0", "-3"], []),
    (["etcd"], "--quota-backend-bytes", ["abc", "-5", "0", "1x", "nan"], []),
    (["etcd"], "--compaction-retention", ["abc", "-5m", "5x"], []),
    (["status"], "--events", ["abc", "-3"], ENDPOINT),
    (["check"], "--min-cpu-gflops", ["abc", "-1", "nan", "inf"], []),
    (["check"], "--min-gpu-matmul-ratio", ["abc", "1.5"], []),
    (["check"], "--timeout", ["abc", "0"], []),
    (["status"], "--timeout", ["abc", "nan", "inf", "-1", "0"], ENDPOINT),
    (["status"], "--rdzv-endpoint", ["localhost:70000", "localhost:abc"], []),
    (["ckpt", "delete"], "--keep-last", ["abc", "0", "-1"], ["/nonexistent-root"]),
    (["ckpt", "load"], "--world-size", ["abc", "0", "-2"], ["/nonexistent-root", "--out", "x"]),
    (["ckpt", "load"], "--max-shard-size", ["abc", "-1", "0", "1x"], ["/nonexistent-root", "--out", "x"]),
    (["ckpt", "save"], "--timeout", ["abc", "nan", "0", "-1"], [*ENDPOINT, "--rdzv-id", "j"]),
    (["ckpt", "save"], "--etcd-timeout", ["abc", "inf", "0"], [*ENDPOINT, "--rdzv-id", "j"]),
]
TYPER_ENV: List[Tuple[List[str], str, str, List[str]]] = [  # (command, variable, bad value, more words)
    (["etcd"], "ELASTICRUN_ETCD_COMPACTION_RETENTION", "abc", []),
    (["status"], "ELASTICRUN_RDZV_ENDPOINT", "localhost:70000", []),
    (["ckpt", "save"], "ELASTICRUN_ETCD_TIMEOUT", "-1", [*ENDPOINT, "--rdzv-id", "j"]),
]


def typer_cases() -> Iterator[Tuple[str, Case]]:
    for words, flag, values, more in TYPER_VALUES:
        for value in values:
            yield f"{' '.join(words)} {flag} {value}", ([*words, flag, value, *more], {}, "")
    for words, var, value, more in TYPER_ENV:
        yield f"{' '.join(words)} {var}={value}", ([*words, *more], {var: value}, "")


CASES = list(run_cases()) + list(typer_cases())


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value that slipped through fails the test instead of starting anything; no stray variable helps."""

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the bad value was accepted: the command went on to start")

    monkeypatch.setattr("elasticrun.launch.agent.run_agent", refuse)
    monkeypatch.setattr(EtcdServer, "start", refuse)
    monkeypatch.setattr(EtcdSettings, "connect", refuse)
    for var in list(os.environ):
        if var.startswith(("PET_", "ELASTICRUN_", "TORCH_ELASTIC_")):
            monkeypatch.delenv(var)


def _run(argv: List[str], env: Dict[str, str], monkeypatch: pytest.MonkeyPatch,
         capsys: pytest.CaptureFixture[str]) -> Tuple[Optional[int], str, str]:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as ended:
        cli_main.main(argv)
    out, err = capsys.readouterr()
    return ended.value.code, out, err  # type: ignore[return-value]


@pytest.mark.parametrize("case", [c for _, c in CASES], ids=[i for i, _ in CASES])
def test_a_bad_value_is_one_line_and_exit_2(case: Case, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    argv, env, where = case
    code, out, err = _run(argv, env, monkeypatch, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err
    assert len(lines) == 1 and lines[0].startswith("elasticrun: error: "), err
    if where:
        assert lines[0].startswith(f"elasticrun: error: {where}"), (where, lines[0])
    else:  # a typer command: the flag, or the variable the value came from, is named
        named = next(iter(env), "") or next(w for w in argv if w.startswith("--"))
        assert named in lines[0], (named, lines[0])


def _numeric_typer_options() -> Iterator[Tuple[str, str]]:
    """(command, flag) of every option of the typer commands that takes a number, size or duration."""
    cli_main._register()
    commands = [(str(c.name), c.callback) for c in cli_main.app.registered_commands]
    for group in cli_main.app.registered_groups:
        commands += [(f"{group.name} {c.name}", c.callback) for c in group.typer_instance.registered_commands]
    for name, fn in commands:
        if fn is None:
            continue
        hints = typing.get_type_hints(fn)
        for pname, param in inspect.signature(fn).parameters.items():
            info = param.default
            decls = [d for d in getattr(info, "param_decls", None) or () if d.startswith("--")]
            if not decls:
                continue
            kind = hints.get(pname)
            kind = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
            sized = getattr(info, "metavar", None) == "SIZE" or "retention" in pname or "timeout" in pname
            if kind in (int, float) or sized:
                yield name, decls[0]


def test_every_numeric_option_of_the_typer_commands_is_swept() -> None:
    swept = {(" ".join(words), flag) for words, flag, _, _ in TYPER_VALUES}
    found = set(_numeric_typer_options())
    assert found, "no numeric option found: the lookup is broken"
    missing = sorted(found - swept)
    assert not missing, f"add bad-value cases for {missing}"
