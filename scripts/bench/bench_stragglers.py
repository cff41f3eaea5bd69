"""Straggler detection's false-positive budget: healthy nodes of examples/train.py, nobody may be flagged.

    python scripts/bench/bench_stragglers.py --minutes 10 --json /tmp/stragglers.json
    python scripts/bench/bench_stragglers.py --minutes 3 --slow --hidden 16384 --batch-size 32 --json /tmp/slow.json

``elasticrun status --json`` is read every ``--every`` s and the readings that flag a node are counted; with
``--slow`` the figure is the time until the pulsed node is flagged (docs/reliability.md, "False positives").
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

import psutil
from common import TRAIN, Agents, AgentsExited, send, shown_command, status_json, summary_row, write_json

from elasticrun.store.server import EtcdServer

PERIOD_S = 0.04  # one SIGSTOP and one SIGCONT of --slow: short, so that stops hit a step's compute as often as not


def pulse(pids: List[int], done: threading.Event, stop_s: float, run_s: float) -> None:
    """SIGSTOP ``pids`` for ``stop_s``, SIGCONT them for ``run_s``, and again until ``done`` is set."""
    while not done.is_set():
        for sig, wait in ((signal.SIGSTOP, stop_s), (signal.SIGCONT, run_s)):
            for pid in pids:
                send(pid, sig)
            done.wait(wait)
    for pid in pids:
        send(pid, signal.SIGCONT)


def all_train(endpoint: str, job: str, nodes: int) -> Optional[bool]:
    """True once every node's worker reports progress in the current round."""
    doc = status_json(endpoint, job)[0] or {}
    ms = doc.get("members") or []
    return len(ms) == nodes and all((m.get("progress") or {}).get("round") == doc["round"] for m in ms) or None


def measure(args: argparse.Namespace, endpoint: str, job: str) -> Dict[str, Any]:
    """Read the job's status every ``--every`` s for ``--minutes`` (with ``--slow``: until the first flag)."""
    t0 = time.monotonic()
    readings, flagged, first_flag, worst = 0, 0, None, 0.0
    while time.monotonic() - t0 < args.minutes * 60 and not (args.slow and flagged):
        doc = status_json(endpoint, job)[0]
        if doc is not None:
            readings += 1
            worst = max([worst, *(r["ratio"] for r in ((doc.get("stragglers") or {}).get("ranks") or {}).values())])
            flagged += any(m.get("straggler") for m in doc["members"])
            first_flag = time.monotonic() - t0 if flagged and first_flag is None else first_flag
        if not (args.slow and flagged):
            time.sleep(args.every)
    return {"nodes": args.nodes, "minutes": round((time.monotonic() - t0) / 60, 2), "readings": readings,
            "flagged_readings": flagged, "first_flag_s": None if first_flag is None else round(first_flag, 1),
            "max_ratio_seen": round(worst, 3), "window_s": args.window, "slow": args.slow,
            "stopped": args.stopped if args.slow else 0.0, "hidden": args.hidden, "batch_size": args.batch_size}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=5.0)
    ap.add_argument("--window", type=float, default=30.0, help="--straggler-window of the agents")
    ap.add_argument("--slow", action="store_true", help="pulse the last node's workers (see --stopped)")
    ap.add_argument("--stopped", type=float, default=0.5, help="--slow: the share of the time they are stopped")
    ap.add_argument("--hidden", type=int, default=32, help="examples/train.py --hidden: the step's compute")
    ap.add_argument("--batch-size", type=int, default=8, help="examples/train.py --batch-size")
    ap.add_argument("--json", default="", help="write the result (with its summary rows) here")
    args = ap.parse_args()
    if not 0.0 <= args.stopped <= 1.0:
        ap.error(f"--stopped {args.stopped:g} is not a share of the time: give a number from 0 to 1 (0.5: half)")
    job = f"strag-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="elasticrun-bench-stragglers-") as work, \
            EtcdServer(data_dir=f"{work}/etcd") as server:
        agents = Agents()
        pulsing = threading.Event()
        try:
            for i in range(args.nodes):
                agents.start(f"n{i}", [
                    sys.executable, "-m", "elasticrun", "--nnodes", f"2:{args.nodes}", "--nproc-per-node", "1",
                    "--rdzv-endpoint", server.endpoint, "--rdzv-id", job, "--node-id", f"n{i}",
                    "--straggler-window", str(args.window), "--stability-window", "3", "-q", str(TRAIN), "--epochs",
                    "100000", "--no-checkpoint", "--dataset-size", "512", "--batch-size", str(args.batch_size),
                    "--hidden", str(args.hidden), "--step-sleep", "0.02"])
            try:
                agents.wait_for(lambda: all_train(server.endpoint, job, args.nodes), 300, "every node to train")
            except (TimeoutError, AgentsExited) as err:
                print(f"bench_stragglers: {err}", file=sys.stderr)
                return 1
            if args.slow:
                slow = psutil.Process(agents.procs[f"n{args.nodes - 1}"].pid)
                kids = [p.pid for p in slow.children(recursive=True)]
                stop_s = PERIOD_S * args.stopped
                threading.Thread(target=pulse, args=(kids, pulsing, stop_s, PERIOD_S - stop_s), daemon=True).start()
            result = measure(args, server.endpoint, job)
        finally:
            pulsing.set()
            agents.stop()
    result["command"] = shown_command(__file__)
    metric = (f"seconds until a node stopped {args.stopped:.0%} of the time is flagged" if args.slow
              else "flagged readings of healthy nodes")
    value = (result["first_flag_s"] or 0.0) if args.slow else float(result["flagged_readings"])
    result["summary"] = [summary_row(metric, value, "none", None, unit="s" if args.slow else "readings",
                                     command=result["command"])]
    print(json.dumps(result, indent=1))
    write_json(args.json, result)
    return 0 if (result["first_flag_s"] is not None) == args.slow else 1


if __name__ == "__main__":
    raise SystemExit(main())
