"""Every ``elasticrun ckpt`` sub-command, run as a real process: output, exit codes, one-line errors."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from elasticrun.checkpoint import Shard, list_checkpoints, load, save

from helpers.ckpt import cli
from helpers.procs import wait_until

pytestmark = pytest.mark.integration  # starts etcd or processes

WAITING = re.compile(r"^elasticrun: (still )?waiting for ")


def _one_line_error(res, code, *fragments):
    """Exit ``code`` and one error line (besides the lines saying what the command waits for)."""
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip() and not WAITING.match(ln)]
    assert len(lines) == 1 and lines[0].startswith("elasticrun: error: "), res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "ckpts"
    g = torch.Generator().manual_seed(0)
    state = {"model": {"w": torch.randn(6, 4, generator=g), "e": torch.randn(3, 5, generator=g).bfloat16()},
             "head": {"b": torch.arange(4.0)}, "lr": 0.5}
    for step in (10, 20):
        save(state, r, training_state={"step": step, "epoch": 1}, user_metadata={"run": "t"},
             placements={"model.w": Shard(0)})
    (r / ".step-00000030.tmp-deadbeef").mkdir()  # a crashed save
    return r


def test_list_table_and_json(root):
    res = cli("list", str(root))
    assert res.returncode == 0, res.stderr
    assert "step-00000020 ← latest" in res.stdout and "incomplete" in res.stdout and "complete" in res.stdout
    res = cli("list", str(root), "--json")
    rows = json.loads(res.stdout)
    assert [(r["name"], r["status"], r["latest"], r["step"]) for r in rows] == [
        ("step-00000010", "complete", False, 10), ("step-00000020", "complete", True, 20),
        ("step-00000030", "incomplete", False, None)]
    _one_line_error(cli("list", str(root / "nope")), 5, "does not exist")


def test_inspect(root):
    res = cli("inspect", str(root), "step-00000010")
    assert res.returncode == 0, res.stderr
    assert "model.w" in res.stdout and "Shard(0) over 1 rank" in res.stdout and "BF16" in res.stdout
    doc = json.loads(cli("inspect", str(root), "--json").stdout)
    assert doc["name"] == "step-00000020" and doc["training_state"]["step"] == 20
    assert doc["tensors"]["model.e"]["shape"] == [3, 5] and doc["tensors"]["model.e"]["bytes"] == 30
    assert doc["user_metadata"] == {"run": "t"}
    _one_line_error(cli("inspect", str(root), "step-00000030"), 5, "no checkpoint 'step-00000030'")
    _one_line_error(cli("inspect", str(root), "../../etc"), 5, "invalid checkpoint name")


def test_verify(root):
    res = cli("verify", str(root), "step-00000010")
    assert res.returncode == 0 and "ok step-00000010" in res.stdout, res.stderr
    assert json.loads(cli("verify", str(root), "--json").stdout)["ok"] is True
    shard = root / "step-00000010" / "shard-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    _one_line_error(cli("verify", str(root), "step-00000010"), 5, "shard-00000-of-00001.safetensors", "corrupt")
    res = cli("verify", str(root), "step-00000010", "--json")
    assert res.returncode == 5 and json.loads(res.stdout)["ok"] is False


def test_delete(root):
    _one_line_error(cli("delete", str(root)), 2, "exactly one")
    _one_line_error(cli("delete", str(root), "../outside", "--yes"), 5, "invalid checkpoint name")
    _one_line_error(cli("delete", str(root), "step-00000010"), 2, "--yes")
    _one_line_error(cli("delete", str(root), "nope", "--yes"), 5, "no checkpoint 'nope'")
    res = cli("delete", str(root), "step-00000010", input="n\n")  # stdin not a tty: refuses, deletes nothing
    assert res.returncode != 0 and len(list_checkpoints(root)) == 3
    assert cli("delete", str(root), "--incomplete", "--yes").returncode == 0
    assert [i.name for i in list_checkpoints(root)] == ["step-00000010", "step-00000020"]
    assert cli("delete", str(root), "--keep-last", "1", "--yes").returncode == 0
    assert [i.name for i in list_checkpoints(root)] == ["step-00000020"]
    _one_line_error(cli("delete", str(root), "step-00000020", "--yes"), 5, "no complete checkpoint would be left")
    assert cli("delete", str(root), "step-00000020", "--yes", "--force").returncode == 0
    assert list_checkpoints(root) == []


def test_load_consolidate_and_reshard(root, tmp_path):
    out = tmp_path / "model.safetensors"
    res = cli("load", str(root), "step-00000020", "--out", str(out), "--only", "model.", "--strip-prefix")
    assert res.returncode == 0, res.stderr
    tensors = load_file(str(out))
    original = load(root, "step-00000020").state_dict
    assert sorted(tensors) == ["e", "w"] and torch.equal(tensors["w"], original["model"]["w"])
    assert torch.equal(tensors["e"], original["model"]["e"])
    res = cli("load", str(root), "--out", str(tmp_path / "re"), "--world-size", "3", "--name", "resharded")
    assert res.returncode == 0, res.stderr
    re = load(tmp_path / "re", "resharded")
    assert re.world_size == 3 and torch.equal(re.state_dict["model"]["w"], original["model"]["w"])
    assert re.state_dict["lr"] == 0.5 and re.training_state.step == 20
    _one_line_error(cli("load", str(root), "--out", str(tmp_path / "x.bin")), 2, ".safetensors")
    _one_line_error(cli("load", str(root), "--out", str(tmp_path / "re"), "--world-size", "2", "--name", "resharded"),
                    5, "already exists")
    _one_line_error(cli("load", str(root), "--out", str(out), "--only", "nothing."), 5, "no tensor starting with")


def test_save_from_file(tmp_path):
    pt, st = tmp_path / "m.pt", tmp_path / "m.safetensors"
    torch.save({"w": torch.ones(3), "step": 4}, pt)
    save_file({"w": torch.zeros(2)}, str(st))
    root = tmp_path / "r"
    assert cli("save", "--from", str(pt), str(root), "from-pt").returncode == 0
    assert cli("save", "--from", str(st), str(root), "from-st").returncode == 0
    assert torch.equal(load(root, "from-pt").state_dict["w"], torch.ones(3)) and load(root, "from-pt").state_dict[
        "step"] == 4
    assert torch.equal(load(root, "from-st").state_dict["w"], torch.zeros(2))
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    _one_line_error(cli("save", "--from", str(tmp_path / "junk.pt"), str(root), "j"), 5, "cannot read")
    _one_line_error(cli("save", "--from", str(tmp_path / "missing.pt"), str(root), "j"), 5, "no such file")
    _one_line_error(cli("save", "--from", str(pt), str(root), "from-pt"), 5, "already exists")
    _one_line_error(cli("save"), 2, "--rdzv-endpoint")


def test_save_asks_a_running_job_through_etcd(etcd_server, etcd, job_id, tmp_path):
    prefix = f"/elasticrun/{job_id}/"
    etcd.put_json(prefix + "config", {"job": job_id})
    etcd.put_json(prefix + "nodes/A", {"node_id": "A"})  # a node runs the job
    answered = threading.Event()

    def on_events(events):  # the job's rank 0, simulated: answer each request
        for ev in events:
            if ev.deleted or answered.is_set():
                continue
            req = json.loads(ev.value)
            etcd.put_json(f"{prefix}control/checkpoint-done/{req['request_id']}",
                          {"name": "step-00000042", "root": str(tmp_path), "step": 42})
            answered.set()

    cancel = etcd.watch_prefix(prefix + "control/checkpoint/", on_events, lambda err: None)
    try:
        res = cli("save", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id, "--timeout", "30")
        assert res.returncode == 0, res.stderr
        assert "step-00000042" in res.stdout and answered.is_set()
    finally:
        cancel()
    # Nobody answers: a clear timeout, and the request is withdrawn.
    res = cli("save", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id, "--timeout", "1")
    _one_line_error(res, 5, "did not checkpoint within 1s")
    kvs, _ = etcd.get_prefix(prefix + "control/")
    assert kvs == []  # the answered request and its answer are deleted once read, the other withdrawn
    _one_line_error(cli("save", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", "no-such-job"), 2,
                    "no job 'no-such-job'")  # a wrong --rdzv-id is a usage error


def test_save_reports_the_jobs_error(etcd_server, etcd, job_id):
    prefix = f"/elasticrun/{job_id}/"
    etcd.put_json(prefix + "config", {"job": job_id})
    etcd.put_json(prefix + "nodes/A", {"node_id": "A"})

    def on_events(events):
        for ev in events:
            if not ev.deleted:
                rid = json.loads(ev.value)["request_id"]
                etcd.put_json(f"{prefix}control/checkpoint-done/{rid}", {"error": "disk full"})

    cancel = etcd.watch_prefix(prefix + "control/checkpoint/", on_events, lambda err: None)
    try:
        res = cli("save", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", job_id, "--timeout", "30")
        _one_line_error(res, 5, "could not checkpoint: disk full")
    finally:
        cancel()


def test_save_to_a_finished_job_answers_at_once(etcd_server, etcd, job_id, agents, tmp_path):
    """A real job: `ckpt save` while it runs (it never calls the hook) returns as soon as the job
    ends, saying so; `ckpt save` after the end answers at once with when and how it ended; a job
    with keys but no running node, and one without keys, say so too. Old code waited --timeout."""
    from elasticrun.job.keys import JobKeys

    from helpers.launch import ECHO

    pids = tmp_path / "pids"
    pids.mkdir()
    ep = etcd_server.endpoint
    hold = tmp_path / "go"  # the worker exits once this exists: after the request was made
    agent = agents(["run", "--rdzv-backend", "etcd", "--rdzv-endpoint", ep, "--rdzv-id", job_id, "--nnodes", "1",
                    "--nproc-per-node", "1", ECHO], env={"ECHO_HOLD_FILE": str(hold), "ECHO_PID_DIR": str(pids)})
    wait_until(lambda: (pids / "0.pid").exists(), 60, "the worker to start")
    started = time.monotonic()
    answers = []
    saver = threading.Thread(target=lambda: answers.append(
        cli("save", "--rdzv-endpoint", ep, "--rdzv-id", job_id, "--timeout", "120", timeout=150)))
    saver.start()
    wait_until(lambda: etcd.get_prefix(JobKeys(job_id).checkpoint_requests)[0], 60, "the save request in etcd")
    hold.touch()
    assert agent.wait(60) == 0, agent.output()
    saver.join(150)
    waiting = answers[0]
    _one_line_error(waiting, 5, f"job '{job_id}' finished at ", "(succeeded: all workers exited 0)",
                    "before it checkpointed")
    assert time.monotonic() - started < 60, "returned when the job ended, not after --timeout"
    t0 = time.monotonic()
    after = cli("save", "--rdzv-endpoint", ep, "--rdzv-id", job_id, "--timeout", "120")
    _one_line_error(after, 5, f"job '{job_id}' finished at ", " UTC (succeeded", "nothing to checkpoint")
    assert time.monotonic() - t0 < 30
    assert etcd.get_prefix(JobKeys(job_id).control)[0] == [], "no request left behind"
    # Keys but no agent left (all stopped by a signal, or lost): nothing can answer.
    stopped = f"{job_id}-stopped"
    etcd.put_json(JobKeys(stopped).config, {"job": stopped})
    _one_line_error(cli("save", "--rdzv-endpoint", ep, "--rdzv-id", stopped, "--timeout", "120"), 5,
                    "has no running node", "nothing to checkpoint")
    _one_line_error(cli("save", "--rdzv-endpoint", ep, "--rdzv-id", f"{job_id}-none"), 2,
                    f"no job '{job_id}-none' in etcd at {ep}")
