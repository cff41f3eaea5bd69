"""A real hung job's --events-file: the agent logs the ``hang`` (its time is badput of cause ``hang``),
and scripts/perf/plot_job.py events reads and draws the log. Real etcd, agent and worker processes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from helpers.launch import SCRIPTS, run_cli

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("plot_job", ROOT / "scripts" / "perf" / "plot_job.py")
assert spec is not None and spec.loader is not None
plot_job = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_job)

HANG_TIMEOUT = 2.0
pytestmark = pytest.mark.integration


def test_a_hang_is_logged_charged_to_hang_and_drawn(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    proc = run_cli(["--standalone", "--node-id", "nodeE", "--nproc-per-node", "1", "--max-restarts", "1",
                    "--hang-timeout", str(HANG_TIMEOUT), "--no-prewarm", "--events-file", str(events),
                    str(SCRIPTS / "hang_worker.py")], timeout=180)
    assert proc.returncode == 0, proc.stderr
    rows = plot_job.read_events([events])
    kinds = [r["event"] for r in rows]
    assert kinds[0] == "round_formed" and kinds[-1] == "job_ended", kinds
    assert kinds.count("hang") == 1 and kinds.count("round_formed") == 2 and kinds.count("restart") == 1, kinds
    hang = rows[kinds.index("hang")]
    assert hang["node"] == "nodeE" and hang["round"] == 0 and hang["step"] == 9, hang
    assert hang["stalled_s"] >= HANG_TIMEOUT
    assert kinds.index("hang") < kinds.index("restart")
    goodput = rows[-1]["goodput"]
    # the stalled seconds (>= the timeout) and the restart after them are hang, not restart
    assert goodput["badput_s"]["hang"] >= HANG_TIMEOUT, goodput
    assert goodput["badput_s"]["restart"] == 0.0, goodput
    assert [(r, w) for _, r, w in plot_job.world_sizes(rows)] == [(0, 1), (1, 1)]
    text = plot_job.describe(rows)
    assert len(text) == len(rows) and "hang" in text[kinds.index("hang")] and "stalled_s=" in "".join(text)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(SystemExit, match="lacks time, event, node"):
        plot_job.read_events([bad])
    pytest.importorskip("matplotlib")
    out = tmp_path / "timeline.png"
    assert plot_job.main(["events", str(events), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
