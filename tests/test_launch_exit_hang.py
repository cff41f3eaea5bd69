"""The end-of-job hangs: a finished worker that never exits.

What a script leaves in reference cycles (DDP, process groups, tensors) was collected only
inside interpreter shutdown, where gloo's threads can no longer take the GIL: a finished job
sometimes never exited (both workers stuck in ``gc_collect_main``). Pre-warmed interpreters
(a huge long-lived heap after importing torch and torch._dynamo, so rare full collections) hit
it; the warm runner now collects that garbage while the interpreter is still whole.

The second: ``destroy_process_group()`` with DDP still alive, then ``main()`` returns; DDP's
Reducer drops the gloo group's last reference and its destructor joins gloo's worker thread with
the GIL held while that thread waits for the GIL (a torch bug; seen in ~1 of 10 runs of the
example under load). The warm runner keeps destroyed groups until exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from helpers.launch import run_cli
from helpers.procs import SCRIPTS

pytestmark = pytest.mark.integration  # starts etcd or processes

DDP = str(SCRIPTS / "ddp_snapshot.py")
RUN_DEADLINE_S = 90.0


def test_warm_runner_collects_the_scripts_garbage_before_shutdown(tmp_path):
    prefix = str(tmp_path / "probe")
    warm = subprocess.Popen(
        [sys.executable, "-m", "elasticrun.launch.warm", "--", str(SCRIPTS / "gc_probe.py")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    order = {"env": dict(os.environ), "argv": [str(SCRIPTS / "gc_probe.py"), prefix], "module": False,
             "cwd": str(tmp_path)}
    out, _ = warm.communicate((json.dumps(order) + "\n").encode(), timeout=60)
    assert warm.returncode == 0, out.decode()
    # What main() left in a cycle is freed while the interpreter is whole (module globals live in
    # __main__ until shutdown, as with ``python script.py``).
    assert (tmp_path / "probe.local").read_text() == "alive", "the cycle was destroyed during interpreter shutdown"


def _probe_refs(cmd, out, stdin=None):
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def test_warm_runner_keeps_destroyed_groups_until_exit(tmp_path):
    """A destroyed group stays referenced by the launcher, so DDP's Reducer never drops its last
    reference (whose destructor, run with the GIL held, can deadlock with gloo's worker thread)."""
    probe = str(SCRIPTS / "pg_retain_probe.py")
    plain = _probe_refs([sys.executable, probe, str(tmp_path / "plain.json")], tmp_path / "plain.json")
    assert plain == {"refs": 0, "initialized": False}  # the probe sees the difference
    order = {"env": dict(os.environ), "argv": [probe, str(tmp_path / "warm.json")], "module": False,
             "cwd": str(tmp_path)}
    warm = _probe_refs([sys.executable, "-m", "elasticrun.launch.warm", "--", probe], tmp_path / "warm.json",
                       stdin=json.dumps(order) + "\n")
    assert warm == {"refs": 1, "initialized": False}  # unregistered at once, released at exit


def test_ddp_client_restarted_from_standby_always_exits(tmp_path):
    """pytorch/examples' multinode.py pattern, one worker SIGKILLed, one restart: the run ends. (The hangs
    came in about one run of ten: the two tests above hold their causes; this one, the whole path.)"""
    started = time.monotonic()
    proc = run_cli(
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--shutdown-timeout", "5",
         DDP, "4", str(tmp_path / "snap.pt")],
        timeout=RUN_DEADLINE_S,
        env={"DDP_EPOCH_SLEEP": "0.8", "DDP_KILL_AFTER_EPOCH": "1", "DDP_KILL_MARKER": str(tmp_path / "killed"),
             "DDP_SAMPLES": "256"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-4000:]}"
    assert (tmp_path / "killed").exists(), f"the worker was never killed\n{out[-3000:]}"
    assert "Resuming training from snapshot at Epoch 2" in out, f"no restart\n{out[-3000:]}"
    assert "Epoch 3 | Training snapshot saved" in out, f"the last epoch is missing\n{out[-3000:]}"
    print(f"ended after {time.monotonic() - started:.1f} s")
