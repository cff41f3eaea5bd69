"""Preemption within the notice: SIGTERM a running ``examples/train.py`` N times, time each drain.

    python scripts/bench/bench_preemption.py --runs 20 --state-gb 0.4 --notice 30 --max-delay 10   # docs/deploy.md
    python scripts/bench/bench_preemption.py --runs 3 --state-gb 0.05 --max-delay 3  # a quick check (run_all quick)

Each launch (``elasticrun --standalone``, an MLP whose checkpoint is about ``--state-gb`` GB) trains, gets SIGTERM
at a random point and is timed to the agent's exit. A preemption passes when the agent exits 143, the workers
saved a checkpoint at the step they stopped at, the next launch resumes at exactly that step, and the drain took
at most ``--notice`` s. Prints min / median / p90 / p95 / max and exits 1 if any check failed.
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


class Launch:
    """One launch of the job (its log in the work dir) and the steps in its workers' lines."""

    def __init__(self, args: argparse.Namespace, work: Path, index: int) -> None:
        cmd = [sys.executable, "-m", "elasticrun", "--standalone", "--nproc-per-node", str(args.nproc),
               "--shutdown-timeout", str(args.notice), "--max-restarts", "0", str(TRAIN),
               "--hidden", str(hidden_for(args.state_gb)), "--ckpt-dir", str(work / "ckpt"), "--ckpt-every", "0",
               "--keep-last", "2", "--batch-size", "8", "--steps", "1000000", "--dataset-size", "100000"]
        self.agents = Agents(log_dir=work, parse=lambda text, _t: PREFIX.sub("", text.strip()))
        self.proc = self.agents.start(f"launch-{index}", cmd)

    def steps(self, pattern: re.Pattern) -> List[int]:
        """The step of every worker line that ``pattern`` matches, in order."""
        return [int(m[1]) for m in (pattern.match(text) for text in self.agents.found()) if m]

    def trains(self, timeout: float) -> bool:
        """Whether a training step was logged within ``timeout`` s (False: the job ended or hung)."""
        with contextlib.suppress(TimeoutError, AgentsExited):
            return self.agents.wait_for(lambda: self.steps(STEP) or None, timeout, "a training step") is not None
        return False

    def stop(self, timeout: float) -> int:
        """SIGTERM the agent, wait up to ``timeout`` s for its exit, then kill what is left; its exit code."""
        self.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        self.agents.close()
        return self.proc.returncode


def newest_step(ckpt_dir: Path) -> Optional[int]:
    """The step of the newest complete checkpoint (None: none)."""
    from elasticrun.checkpoint import list_checkpoints

    latest = [i for i in list_checkpoints(str(ckpt_dir)) if i.latest]
    if not latest or latest[0].meta is None or not latest[0].meta.training_state:
        return None
    return int(latest[0].meta.training_state.get("step", -1))


def pct(values: List[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def preempt(launch: Launch, i: int, args: argparse.Namespace, rng: random.Random, work: Path) -> Dict[str, object]:
    """SIGTERM launch ``i`` at a random point after its training started; what its drain did."""
    delay = rng.uniform(0.0, args.max_delay)
    time.sleep(delay)
    sent = time.monotonic()
    code = launch.stop(args.notice + 60)
    took = time.monotonic() - sent
    stopped = (launch.steps(STOPPED) or [None])[-1]
    saved = newest_step(work / "ckpt")
    return {"run": i, "delay_s": round(delay, 2), "drain_s": round(took, 2), "exit": code, "stopped_at": stopped,
            "saved_at": saved, "resumed_from": (launch.steps(START) or [None])[0],
            "ok": code == 143 and stopped is not None and saved == stopped and took <= args.notice}


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    """Command-line options."""
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
    """Preempt ``--runs`` launches, check each drain and the next launch's resume, print the distribution."""
    args = parse_args(argv)
    console = Console(stderr=True, highlight=False)
    rng = random.Random(args.seed)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="elasticrun-preempt-"))
    work.mkdir(parents=True, exist_ok=True)
    console.print(Text(f"{args.runs} preemptions of examples/train.py ({args.state_gb} GB state, {args.nproc} "
                       f"workers, notice {args.notice:.0f}s); logs in {work}"))
    rows: List[Dict[str, object]] = []
    for i in range(args.runs + 1):  # the last launch only checks the resume of the last preemption
        launch = Launch(args, work, i)
        try:
            if not launch.trains(600):
                launch.stop(5)
                console.print(Text(f"launch {i}: training never started (see {work}/launch-{i}.log)"))
                return 1
            if rows:  # this launch resumed from the previous preemption's checkpoint
                resumed = (launch.steps(START) or [None])[0]
                expected = rows[-1]["stopped_at"] if rows[-1]["stopped_at"] is not None else -2
                rows[-1].update(resumed_at=resumed, ok=bool(rows[-1]["ok"]) and resumed == expected)
            if i == args.runs:
                break
            rows.append(preempt(launch, i, args, rng, work))
            r = rows[-1]
            console.print(Text(f"  {i + 1}/{args.runs}: SIGTERM after {r['delay_s']:.1f}s -> exit {r['exit']} in "
                               f"{r['drain_s']:.2f}s, stopped at step {r['stopped_at']}, checkpoint at step "
                               f"{r['saved_at']}"))
        finally:  # the last launch, or an interrupted one: leave no job behind
            if launch.proc.poll() is None:
                launch.stop(args.notice + 30)
    drains = [float(r["drain_s"]) for r in rows]  # type: ignore[arg-type]
    quantiles = (("min", 0), ("median", 0.5), ("p90", 0.9), ("p95", 0.95), ("max", 1))
    stats = {q: round(pct(drains, v), 2) for q, v in quantiles}
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
