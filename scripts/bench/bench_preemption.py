"""Preemption within the notice: SIGTERM a running ``examples/train.py`` N times, time each drain.

Each round starts ``elasticrun --standalone`` with ``examples/train.py`` (an MLP whose checkpoint is
about ``--state-gb`` GB: model and SGD momentum), lets it train, sends SIGTERM to the agent at a random
point and measures SIGTERM -> agent exit. Checked for every preemption:

- the agent exits with the retryable code 143 (``ExitCode.DRAINED``);
- the workers saved a checkpoint at the step they stopped at (the newest complete checkpoint);
- the next launch resumes at exactly that step;
- the drain took at most ``--notice`` seconds (Slurm's ``--signal`` lead time, Kubernetes'
  ``terminationGracePeriodSeconds``).

Prints the distribution (min / median / p90 / p95 / max) and exits 1 if any check failed; ``--json`` adds
the p95 against the notice as the ``summary`` row.

    python scripts/bench/bench_preemption.py --runs 20 --state-gb 0.4 --notice 30 --max-delay 10   # docs/deploy.md
    python scripts/bench/bench_preemption.py --runs 3 --state-gb 0.05 --max-delay 3  # a quick check (run_all quick)
"""

from __future__ import annotations

import argparse
import contextlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from common import TRAIN, Agents, AgentsExited, shown_command, summary_row, write_json
from rich.console import Console
from rich.table import Table
from rich.text import Text

PREFIX = re.compile(r"^\[[^\]]*\]:")
START = re.compile(r"^start: .* step (\d+) epoch")
STEP = re.compile(r"^step (\d+) ")
STOPPED = re.compile(r"^stopped: \S+ at step (\d+)")


def hidden_for(state_gb: float) -> int:
    """The MLP width whose checkpoint (18*H float32 parameters, twice with momentum) is ``state_gb``."""
    return max(32, int(state_gb * 1e9 / (2 * 4 * 18)))


class Run:
    """One launch of the job (:class:`common.Agents`, its log in the work dir); rank 0's lines as they come."""

    def __init__(self, args: argparse.Namespace, ckpt_dir: Path, log_dir: Path, index: int) -> None:
        cmd = [sys.executable, "-m", "elasticrun", "--standalone", "--nproc-per-node", str(args.nproc),
               "--shutdown-timeout", str(args.notice), "--max-restarts", "0", str(TRAIN),
               "--hidden", str(hidden_for(args.state_gb)), "--ckpt-dir", str(ckpt_dir), "--ckpt-every", "0",
               "--keep-last", "2", "--batch-size", "8", "--steps", "1000000", "--dataset-size", "100000"]
        self.agents = Agents(log_dir=log_dir, parse=lambda text, _t: PREFIX.sub("", text.strip()))
        self.name = f"launch-{index}"
        self.proc = self.agents.start(self.name, cmd)

    def _first(self, pattern: re.Pattern, last: bool = False) -> Optional[int]:
        """The step in rank 0's first (or last) line that ``pattern`` matches."""
        found = [int(m[1]) for m in (pattern.match(text) for text in self.agents.found()) if m]
        return (found[-1] if last else found[0]) if found else None

    @property
    def start_step(self) -> Optional[int]:
        """The step this launch resumed at."""
        return self._first(START)

    @property
    def stopped_at(self) -> Optional[int]:
        """The step at which the workers stopped on SIGTERM."""
        return self._first(STOPPED, last=True)

    def wait_training(self, timeout: float) -> bool:
        """Whether a training step was logged within ``timeout`` s (False: the job ended or hung)."""
        try:
            return self.agents.wait_for(lambda: self._first(STEP), timeout, "a training step") is not None
        except (TimeoutError, AgentsExited):
            return False

    def finish(self, timeout: float) -> int:
        """Wait up to ``timeout`` s for the agent to exit, then kill what is left; its exit code."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        self.agents.close()
        return self.proc.returncode


def newest_step(ckpt_dir: Path) -> Optional[int]:
    from elasticrun.checkpoint import list_checkpoints

    latest = [i for i in list_checkpoints(str(ckpt_dir)) if i.latest]
    if not latest or latest[0].meta is None or not latest[0].meta.training_state:
        return None
    return int(latest[0].meta.training_state.get("step", -1))


def pct(values: List[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _preempt(run: Run, i: int, args: argparse.Namespace, rng: random.Random, ckpt_dir: Path) -> Dict[str, object]:
    """SIGTERM launch ``i`` at a random point after its training started; what its drain did."""
    delay = rng.uniform(0.0, args.max_delay)
    time.sleep(delay)
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    code = run.finish(args.notice + 60)
    took = time.monotonic() - sent
    saved = newest_step(ckpt_dir)
    return {"run": i, "delay_s": round(delay, 2), "drain_s": round(took, 2), "exit": code,
            "stopped_at": run.stopped_at, "saved_at": saved, "resumed_from": run.start_step,
            "ok": code == 143 and run.stopped_at is not None and saved == run.stopped_at and took <= args.notice}


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="preemptions to measure")
    p.add_argument("--state-gb", type=float, default=0.4, help="checkpoint size of the job (model + momentum)")
    p.add_argument("--nproc", type=int, default=2, help="workers")
    p.add_argument("--notice", type=float, default=30.0, help="the preemption notice: every drain must fit")
    p.add_argument("--max-delay", type=float, default=20.0, help="SIGTERM at a random point up to this long "
                   "after training (re)started")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="", help="checkpoints and logs (default: a temporary directory)")
    p.add_argument("--json", default="", help="also write the results and the summary row to this file")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    console = Console(stderr=True, highlight=False)
    rng = random.Random(args.seed)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="elasticrun-preempt-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt_dir = work / "ckpt"
    console.print(Text(f"{args.runs} preemptions of examples/train.py ({args.state_gb} GB state, {args.nproc} "
                       f"workers, notice {args.notice:.0f}s); logs in {work}"))
    rows: List[Dict[str, object]] = []
    for i in range(args.runs + 1):  # the last launch only checks the resume of the last preemption
        run = Run(args, ckpt_dir, work, i)
        try:
            if not run.wait_training(600):
                run.finish(5)
                console.print(Text(f"launch {i}: training never started (see {work}/launch-{i}.log)"))
                return 1
            if rows:  # this launch resumed from the previous preemption's checkpoint
                last = rows[-1]
                expected = last["stopped_at"] if last["stopped_at"] is not None else -2
                last.update(resumed_at=run.start_step, ok=bool(last["ok"]) and run.start_step == expected)
            if i == args.runs:
                run.proc.send_signal(signal.SIGTERM)
                run.finish(args.notice + 30)
                break
            rows.append(_preempt(run, i, args, rng, ckpt_dir))
            r = rows[-1]
            console.print(Text(f"  {i + 1}/{args.runs}: SIGTERM after {r['delay_s']:.1f}s -> exit {r['exit']} in "
                               f"{r['drain_s']:.2f}s, stopped at step {r['stopped_at']}, checkpoint at step "
                               f"{r['saved_at']}"))
        except BaseException:
            if run.proc.poll() is None:  # interrupted: leave no job behind
                run.proc.send_signal(signal.SIGTERM)
                run.finish(args.notice + 30)
            raise
    drains = [float(r["drain_s"]) for r in rows]  # type: ignore[arg-type]
    stats = {q: round(pct(drains, v), 2) for q, v in (("min", 0), ("median", 0.5), ("p90", 0.9), ("p95", 0.95),
                                                       ("max", 1))}
    failed = [r for r in rows if not r["ok"]]
    table = Table(title="SIGTERM -> agent exit (s)")
    for col in ("runs", *stats, "notice", "failed"):
        table.add_column(col, justify="right")
    table.add_row(str(len(rows)), *(f"{v:.2f}" for v in stats.values()), f"{args.notice:.0f}", str(len(failed)))
    Console().print(table)
    for r in failed:
        console.print(Text(f"FAILED: {r}"))
    if args.json:
        row = summary_row(f"preemption drain, SIGTERM -> saved and exited 143, p95 of {len(rows)} "
                          f"({args.state_gb:g} GB state, {args.nproc} workers)", stats["p95"],
                          "the notice (every drain must fit)", args.notice, command=shown_command(__file__, argv))
        write_json(args.json, {"summary": [row], "drain_s": stats, "failed": len(failed), "runs": rows})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
