"""What the read commands and ``--help`` print into an 80-column pipe (a CI log): whole names, one row per
line, help wrapped at spaces with each default said once; and on a narrow terminal nothing cut either."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

from elasticrun.checkpoint import Shard, save
from elasticrun.cli import console as console_mod
from elasticrun.cli.console import CliConsole
from elasticrun.cli.run_help import option_entry
from elasticrun.cli.run_options import all_options
from elasticrun.cli.status_render import render_job, render_jobs

from helpers.cli import run_main as cli

LONG = "finetune-llama-70b-lora-rank-64-lr-3e-4-warmup-500"
TENSOR = "model.layers.31.self_attn.q_proj.lora_A.default.weight"
NODE = "3fa9c1@gpu-node-017.cluster.example.org:48213"


@pytest.fixture
def pipe80(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's consoles as a pipe of 80 columns sees them (pytest's capture is no terminal)."""
    monkeypatch.setattr(console_mod.console, "width", 80)
    monkeypatch.setattr(console_mod.err_console, "width", 80)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "ckpts"
    for step in (1000, 2000):
        save({"model": {TENSOR.split(".", 1)[1]: torch.zeros(4, 2)}}, r, f"{LONG}-step-{step:08d}",
             training_state={"step": step}, placements={TENSOR: Shard(0)})
    return r


def test_ckpt_list_in_a_pipe_keeps_every_name_whole_one_row_per_line(root: Path, pipe80: None,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(["ckpt", "list", str(root)], capsys)
    assert code == 0, err
    assert "…" not in out and "┃" not in out and "│" not in out, out
    for step in (1000, 2000):
        rows = [ln for ln in out.splitlines() if f"{LONG}-step-{step:08d}" in ln]
        assert len(rows) == 1 and re.search(rf"\bdisk\s+{step}\s", rows[0]), out
    header = [ln for ln in out.splitlines() if ln.startswith("name ")]
    assert header and header[0].split() == ["name", "tier", "step", "epoch", "world", "size", "created", "status"]


def test_ckpt_inspect_in_a_pipe_keeps_tensor_names_whole(root: Path, pipe80: None,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(["ckpt", "inspect", str(root)], capsys)
    assert code == 0, err
    rows = [ln for ln in out.splitlines() if ln.startswith(TENSOR)]
    assert len(rows) == 1 and "F32" in rows[0] and "[4, 2]" in rows[0] and "Shard(0)" in rows[0], out
    assert "…" not in out and f"{LONG}-step-00002000 — written by 1 rank(s)" in out and "1 tensor," in out


def _doc(now: float) -> Dict[str, Any]:
    member = {"group_rank": 0, "node_id": NODE, "host": "gpu-node-017.cluster.example.org", "addr": "10.20.30.40",
              "status": "Active", "ranks": [0, 7], "accelerators": [{"type": "cpu", "count": 8}],
              "lease_heartbeat_age": 1, "lease_ttl": 4, "lease_granted_ttl": 5,
              "progress": {"step": 1234, "loss": 0.25, "samples_per_s": 812.5, "time": now - 1}}
    spare = {"node_id": NODE.replace("017", "018"), "host": "gpu-node-018", "addr": "10.20.30.41",
             "status": "Joining", "nproc": 8, "waiting_for": 4, "registered_at": now - 5, "lease_ttl": 5,
             "lease_granted_ttl": 5}
    event = {"round": 3, "type": "ScaleUp", "old_world_size": 8, "new_world_size": 16, "added": [NODE],
             "removed": [], "reason": "node joined", "time": now - 60}
    return {"job": "llama-70b-lora", "phase": "running", "revision": 42, "round": 3, "world_size": 16,
            "members": [member], "spares": [spare], "events": [event], "nnodes": "1:4", "max_restarts": 3,
            "restart_count": 0, "master_addr": "10.20.30.40", "master_port": 29500, "round_created_at": now - 60,
            "time": now}


def test_status_in_a_pipe_is_one_line_per_node_with_whole_words() -> None:
    out = io.StringIO()
    CliConsole(file=out, width=80).print(render_job(_doc(time.time()), "etcd:2379"))
    text = out.getvalue()
    rows = [ln for ln in text.splitlines() if NODE in ln]
    assert len(rows) == 2, text  # the member, and the rescale event that added it
    member = rows[0]
    assert "gpu-node-017.cluster.example.org" in member and "10.20.30.40" in member and " Active " in member
    assert "step 1234 · loss 0.25 · 812.5/s" in member, member
    header = [ln for ln in text.splitlines() if ln.startswith("grank ")]
    assert header and header[0].split()[:5] == ["grank", "node", "host", "address", "status"], text
    spare = [ln for ln in text.splitlines() if NODE.replace("017", "018") in ln]
    assert len(spare) == 1 and "Joining" in spare[0] and "round 4" in spare[0], text
    listing = io.StringIO()
    CliConsole(file=listing, width=80).print(render_jobs([{"job": "llama-70b-lora-" + "x" * 60, "phase": "running",
                                                          "round": 3, "world_size": 16, "nodes": 2,
                                                          "restart_count": 1, "max_restarts": 3, "nnodes": "1:4"}],
                                                        "etcd:2379"))
    assert re.search(r"^llama-70b-lora-x{60}\s+running\s+3\s+16\s+2\s+1/3\s+1:4$", listing.getvalue(), re.M), \
        listing.getvalue()


@pytest.mark.parametrize("width", [80, 250])
def test_status_on_a_terminal_cuts_no_name(width: int) -> None:
    out = io.StringIO()
    CliConsole(file=out, width=width, force_terminal=True, color_system=None).print(render_job(_doc(time.time())))
    text = out.getvalue()
    assert "…" not in text
    if width == 250:  # wide enough: a table, a node per row
        rows = [ln for ln in text.splitlines() if NODE in ln and "│" in ln]
        assert len(rows) == 2 and " Active " in rows[0], text
    else:  # too narrow for the table: the plain rows, folded at the width, every character kept
        assert max(len(ln) for ln in text.splitlines()) <= width and "┃" not in text, text
        assert NODE in text.replace("\n", ""), text


def _help(argv: List[str], capsys: pytest.CaptureFixture[str]) -> str:
    code, out, err = cli(argv, capsys)
    assert code == 0, err
    return out


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["etcd", "--help"], ["ckpt", "--help"],
                                  ["ckpt", "list", "--help"], ["ckpt", "load", "--help"], ["ckpt", "save", "--help"],
                                  ["status", "--help"]], ids=lambda a: " ".join(a))
def test_help_in_an_80_column_pipe(argv: List[str], pipe80: None, capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(argv, capsys)
    assert "…" not in out and "<bool>" not in out and "╭" not in out and "\\[" not in out, out
    if argv[0] != "status":  # its examples are whole command lines
        wide = [ln for ln in out.splitlines() if len(ln) > 80]
        assert not wide, wide
    for line in out.splitlines():
        assert line.count("[default:") <= 1, line
    if argv[0] in ("--help", "run"):
        flat = " ".join(out.split())
        for opt in all_options():
            for var in ([opt.pet] if opt.pet else []) + list(opt.envvars):
                assert var in out, f"{var} cut or missing"
            assert opt.long in out
            assert flat.count(option_entry(opt).help.split(" [")[0][:40]) >= 1
    if argv == ["status", "--help"]:
        assert "--rdzv-endpoint, --rdzv_endpoint RDZV_ENDPOINT" in out and "[env: ELASTICRUN_RDZV_ENDPOINT]" in out


def test_every_default_is_said_once() -> None:
    for opt in all_options():
        text = option_entry(opt).help
        assert text.count("[default") <= 1 and text.count("(default") + text.count("[default") <= 1, text


def test_a_group_without_its_command_shows_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = cli(["ckpt"], capsys)
    assert code == 2 and err == "" and out.startswith("Usage: elasticrun ckpt [OPTIONS] COMMAND [ARGS]..."), (out, err)
    assert re.search(r"^  verify +Re-hash", out, re.M), out
