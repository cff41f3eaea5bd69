"""Preemption within the notice: SIGTERM a running ``examples/train.py`` N times, time each drain.

    python scripts/bench/bench_preemption.py --runs 20 --state-gb 0.4 --notice 30 --max-delay 10   # docs/deploy.md
    python scripts/bench/bench_preemption.py --runs 3 --state-gb 0.05 --max-delay 3  # a quick check (run_all quick)

A preemption passes when the agent exits 143 within ``--notice`` s, the workers saved a checkpoint at the step
they stopped at and the next launch resumes there. Prints min / median / p90 / p95 / max; exits 1 if any check
failed, and only then keeps the work dir (checkpoints and logs).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from common import TRAIN, Agents, AgentsExited, md_table, shown_command, summary_row, write_json

from elasticrun.checkpoint import list_checkpoints

PREFIX = re.compile(r"^\[[^\]]*\]:")
START = re.compile(r"^start: .* step (\d+) epoch")
STEP = re.compile(r"^step (\d+) ")
STOPPED = re.compile(r"^stopped: \S+ at step (\d+)")


class Launch:
    """One launch of the job (its log in the work dir) and the steps in its workers' lines."""

    def __init__(self, args: argparse.Namespace, work: Path, index: int) -> None:
        hidden = max(32, int(args.state_gb * 1e9 / (2 * 4 * 18)))  # 18*H float32 parameters, twice with momentum
        cmd = [sys.executable, "-m", "elasticrun", "--standalone", "--nproc-per-node", str(args.nproc),
               "--shutdown-timeout", str(args.notice), "--max-restarts", "0", str(TRAIN), "--hidden", str(hidden),
               "--ckpt-dir", str(work / "ckpt"), "--ckpt-every", "0", "--keep-last", "2", "--batch-size", "8",
               "--steps", "1000000", "--dataset-size", "100000"]
        self.agents = Agents(log_dir=work, parse=lambda text, _t: PREFIX.sub("", text.strip()))
        self.proc = self.agents.start(f"launch-{index}", cmd)

    def first(self, pattern: re.Pattern, last: bool = False) -> Optional[int]:
        """The step of the first (or ``last``) worker line that ``pattern`` matches (None: none)."""
        steps = [int(m[1]) for m in (pattern.match(text) for text in self.agents.found()) if m]
        return (steps[-1] if last else steps[0]) if steps else None

    def trains(self, timeout: float) -> bool:
        """Whether a training step was logged within ``timeout`` s (False: the job ended or hung)."""
        with contextlib.suppress(TimeoutError, AgentsExited):
            return self.agents.wait_for(lambda: self.first(STEP), timeout, "a training step") is not None
        return False


def newest_step(ckpt_dir: Path) -> Optional[int]:
    """The step of the newest complete checkpoint (None: none)."""
    meta = next((i.meta for i in list_checkpoints(str(ckpt_dir)) if i.latest), None)
    return int(meta.training_state.get("step", -1)) if meta is not None and meta.training_state else None


def preempt_all(args: argparse.Namespace, work: Path) -> Optional[List[Dict[str, Any]]]:
    """Preempt ``--runs`` launches; each one's drain and the next launch's resume (None: a launch never trained)."""
    rng = random.Random(0)
    rows: List[Dict[str, Any]] = []
    for i in range(args.runs + 1):  # the last launch only checks the resume of the last preemption
        launch = Launch(args, work, i)
        try:
            if not launch.trains(600):
                launch.agents.stop(5)
                print(f"launch {i}: training never started (see {work}/launch-{i}.log)", file=sys.stderr)
                return None
            if rows:  # this launch resumed from the previous preemption's checkpoint
                prev = rows[-1]
                prev["resumed_at"] = launch.first(START)
                prev["ok"] &= prev["stopped_at"] is not None and prev["resumed_at"] == prev["stopped_at"]
            if i == args.runs:
                break
            delay = rng.uniform(0.0, args.max_delay)
            time.sleep(delay)
            sent = time.monotonic()
            code = launch.agents.stop(args.notice + 60)[0]  # SIGTERM, the drain, its exit code
            took, stopped, saved = time.monotonic() - sent, launch.first(STOPPED, last=True), newest_step(work / "ckpt")
            rows.append({"run": i, "delay_s": round(delay, 2), "drain_s": round(took, 2), "exit": code,
                         "stopped_at": stopped, "saved_at": saved, "resumed_from": launch.first(START),
                         "ok": code == 143 and stopped is not None and saved == stopped and took <= args.notice})
            print(f"  {i + 1}/{args.runs}: SIGTERM after {delay:.1f}s -> exit {code} in {took:.2f}s, stopped at step "
                  f"{stopped}, checkpoint at step {saved}", file=sys.stderr)
        finally:  # the last launch, or an interrupted one: leave no job behind
            if launch.proc.poll() is None:
                launch.agents.stop(args.notice + 30)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="preemptions to measure")
    p.add_argument("--state-gb", type=float, default=0.4, help="checkpoint size of the job (model + momentum)")
    p.add_argument("--nproc", type=int, default=2, help="workers")
    p.add_argument("--notice", type=float, default=30.0, help="the preemption notice: every drain must fit")
    p.add_argument("--max-delay", type=float, default=20.0, help="SIGTERM at a random point up to this long "
                   "after training (re)started")
    p.add_argument("--json", default="", help="also write the results and the summary row to this file")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="elasticrun-preempt-"))
    print(f"{args.runs} preemptions of examples/train.py ({args.state_gb} GB state, {args.nproc} workers, notice "
          f"{args.notice:.0f}s); logs in {work}", file=sys.stderr)
    rows = preempt_all(args, work)
    failed = [r for r in rows or [] if not r["ok"]]
    if rows is None or failed:
        print("".join(f"FAILED: {r}\n" for r in failed) + f"logs kept in {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    if rows is None:
        return 1
    drains = sorted(r["drain_s"] for r in rows)
    stats = {q: drains[round(v * (len(drains) - 1))] for q, v in (("min", 0), ("median", 0.5), ("p90", 0.9),
                                                                   ("p95", 0.95), ("max", 1))}
    print("SIGTERM -> agent exit (s)\n" + md_table(
        ["runs", *stats, "notice", "failed"],
        [[len(rows), *(f"{v:.2f}" for v in stats.values()), f"{args.notice:.0f}", len(failed)]], "r" * 8))
    row = summary_row(f"preemption drain, SIGTERM -> saved and exited 143, p95 of {len(rows)} "
                      f"({args.state_gb:g} GB state, {args.nproc} workers)", stats["p95"],
                      "the notice (every drain must fit)", args.notice, command=shown_command(__file__, argv))
    write_json(args.json, {"summary": [row], "drain_s": stats, "failed": len(failed), "runs": rows})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
