"""plan_listing: the gathered entries of both tiers -> what `elasticrun ckpt list` says (no files read)."""

from __future__ import annotations

import io
from typing import Any, Optional

from rich.console import Console

from elasticrun.checkpoint.format import CheckpointMeta
from elasticrun.checkpoint.validate import CheckpointInfo, CheckpointStatus
from elasticrun.cli.ckpt_list import listing_json, listing_table, plan_listing, shows_memory
from elasticrun.cli.ckpt_memory import MemoryRow, SnapshotDir

NO_AGENT_NOTE = " (no running elasticrun agent of yours keeps any in /dev/shm)"


def info(name: str, status: CheckpointStatus = CheckpointStatus.COMPLETE, step: Optional[int] = 10,
         **fields: Any) -> CheckpointInfo:
    fields.setdefault("meta", CheckpointMeta(name, 4, 0.0, {}, {}, None,
                                             training_state=None if step is None else {"step": step}))
    return CheckpointInfo(name, name, status, size=3 << 20, **fields)


def memory(name: str, kind: str = "generation") -> MemoryRow:
    return MemoryRow(info(name), SnapshotDir("/dev/shm/x", "job_1", 4242), kind, "/dev/shm/x/generations")


def test_which_tiers_are_listed():
    assert shows_memory(None, None) and not shows_memory("/ckpts", None)
    assert shows_memory("/ckpts", True) and not shows_memory(None, False)


def test_an_empty_root_and_no_memory_snapshots_are_said_and_draw_no_table():
    listing = plan_listing("/ckpts", [], [], job="j1")
    assert listing.notes == ("no checkpoints in /ckpts",
                             "no memory snapshots on this machine for job j1" + NO_AGENT_NOTE)
    assert listing.rows == ()
    assert plan_listing(None, [], [], None).notes == ("no memory snapshots on this machine" + NO_AGENT_NOTE,)


def test_rows_of_both_tiers_disk_first_with_their_cells():
    listing = plan_listing("/ckpts", [info("step-1", step=None), info("step-2", meta=None)],
                           [memory("gen-3"), memory("gen-2", "replica")])
    assert listing.notes == () and listing.title == "checkpoints in /ckpts and this machine's memory"
    assert [(r.info.name, r.tier, r.owner) for r in listing.rows] == [
        ("step-1", "disk", ""), ("step-2", "disk", ""), ("gen-3", "memory", "(job job_1, agent 4242)"),
        ("gen-2", "memory replica", "(job job_1, agent 4242)")]
    first, second = listing.rows[:2]
    assert (first.step, first.epoch, first.world, first.size) == ("-", "-", "4", "3.0 MiB")
    assert (second.step, second.world, second.created) == ("-", "-", "-")
    assert listing.rows[2].step == "10"


def test_a_root_without_memory_is_titled_by_the_root_alone():
    listing = plan_listing("/ckpts", [info("a")], None)
    assert listing.title == "checkpoints in /ckpts" and listing.notes == ()


def test_json_has_disk_then_memory_entries():
    doc = listing_json("/ckpts", [info("a")], [memory("g")])
    assert [(d["name"], d["tier"], d["root"]) for d in doc] == [("a", "disk", "/ckpts"),
                                                                 ("g", "memory", "/dev/shm/x/generations")]
    assert doc[1]["job"] == "job_1" and doc[1]["agent_pid"] == 4242


def test_the_table_marks_latest_aliases_and_problems_verbatim():
    entries = [info("[b]step-1", latest=True), info("best", CheckpointStatus.ALIAS, alias_of="step-1"),
               info("step-2", CheckpointStatus.CORRUPT, problem="file x is missing")]
    out = io.StringIO()
    Console(file=out, width=200).print(listing_table(plan_listing("/ckpts", entries, None)))
    text = out.getvalue()
    assert "[b]step-1 ← latest" in text and "best → step-1 (alias)" in text
    assert "corrupt (file x is missing)" in text and "alias" in text
