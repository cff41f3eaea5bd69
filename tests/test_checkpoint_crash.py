"""A save SIGKILLed at each phase leaves the previous checkpoint intact and loadable, the
partial one reported incomplete and never loaded; same when one rank of a gloo group dies."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from elasticrun.checkpoint import list_checkpoints, load
from elasticrun.checkpoint.commit import CRASH_ENV, PHASES

from helpers.ckpt import REPO, child_env, run_group

pytestmark = pytest.mark.integration  # starts etcd or processes

CHILD = [sys.executable, str(REPO / "tests" / "scripts" / "ckpt_save_child.py")]


def _save(root, name, step, crash=None):
    env = child_env({CRASH_ENV: crash} if crash else {})
    return subprocess.run([*CHILD, str(root), name, str(step)], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def good_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    assert _save(root, "good", 1).returncode == 0
    return root


@pytest.mark.parametrize("phase", PHASES)
def test_crash_at_each_phase(good_root, tmp_path, phase):
    import shutil

    root = tmp_path / "root"
    shutil.copytree(good_root, root)
    proc = _save(root, "new", 2, crash=phase)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    infos = {i.name: i for i in list_checkpoints(root)}
    committed = phase == "after-commit"
    assert infos["good"].status == "complete"
    if committed:
        assert infos["new"].status == "complete" and infos["new"].latest
    elif phase == "start":
        assert "new" not in infos  # killed before anything was written
    else:
        assert infos["new"].status == "incomplete" and infos["new"].temporary and infos["good"].latest
    res = load(root, "latest")
    expect = 2.0 if committed else 1.0
    assert res.name == ("new" if committed else "good")
    assert torch.all(res.state_dict["w"] == expect) and res.state_dict["step"] == int(expect)
    assert torch.all(res.state_dict["v"] == -expect) and len(res.meta.files) == 2  # two files, written in parallel
    if not committed:
        with pytest.raises(Exception, match="no checkpoint 'new'"):
            load(root, "new")


def test_rank_killed_mid_write_under_gloo(tmp_path):
    root = tmp_path / "root"
    results = run_group("crash", 2, root, tmp_path, timeout=90, env={"CKPT_TEST_CRASH_AT": "shard-write:1"})
    assert results[1].returncode == -signal.SIGKILL
    assert results[0].returncode != 0  # its peer vanished mid-collective: it fails, it doesn't commit
    infos = {i.name: i for i in list_checkpoints(root)}
    assert infos["good"].status == "complete" and infos["good"].latest
    assert infos["doomed"].status == "incomplete"
    assert load(root).name == "good"
