"""examples/train.py's sleep flags: ``--compute-sleep`` defaults to ``$TRAIN_COMPUTE_SLEEP`` (one node's
environment makes that node slow while every node runs the same command); bad values are one usage line."""

from __future__ import annotations

import functools
import importlib.util

import pytest

from helpers.procs import REPO


@functools.cache
def example():
    """examples/train.py as a module, loaded once (its parse_args reads the environment at each call)."""
    spec = importlib.util.spec_from_file_location("example_train", REPO / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(argv, monkeypatch, env=None):
    monkeypatch.delenv("TRAIN_COMPUTE_SLEEP", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    return example().parse_args(argv)


def test_compute_sleep_comes_from_the_environment_unless_given(monkeypatch):
    assert parse([], monkeypatch).compute_sleep == 0.0
    assert parse([], monkeypatch, {"TRAIN_COMPUTE_SLEEP": "0.03"}).compute_sleep == 0.03
    assert parse(["--compute-sleep", "0.2"], monkeypatch, {"TRAIN_COMPUTE_SLEEP": "0.03"}).compute_sleep == 0.2


@pytest.mark.parametrize("argv, env, said", [
    (["--compute-sleep", "-1"], {}, "--compute-sleep -1 is negative: give seconds >= 0"),
    (["--step-sleep", "-0.5"], {}, "--step-sleep -0.5 is negative: give seconds >= 0"),
    ([], {"TRAIN_COMPUTE_SLEEP": "fast"}, "argument --compute-sleep: invalid float value: 'fast'"),
])
def test_a_bad_sleep_is_one_usage_line(argv, env, said, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(argv, monkeypatch, env)
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(said)
