#!/usr/bin/env python
"""Does a scrape storm on the agent's /metrics slow training? Step time with and without one.

    python scripts/bench/bench_metrics.py                                  # 3 pairs, 200 steps, 50 scrapers
    python scripts/bench/bench_metrics.py --runs 1 --steps 60 --threads 10 # a small version (~1 min)
    python scripts/bench/bench_metrics.py --interval 1                     # 50 scrapes/s (Prometheus: 1 per 15 s)

Each run is a real job (``elasticrun --standalone --metrics-port P examples/train.py --metrics-log``); runs
alternate quiet / storm so that drifting load hits both alike. The step time is rank 0's median from step
``--skip`` on; the storm is ``--threads`` threads scraping back to back (or every ``--interval`` s), with scrape
count, errors, latency and the agent's CPU seconds reported (docs/performance.md, "Metrics endpoint").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List

import psutil
from common import TRAIN, Agents, shown_command, summary_row, write_json

from elasticrun.store.server import free_port


class Storm:
    """``threads`` scrapers hitting ``http://127.0.0.1:port/metrics`` until stopped."""

    def __init__(self, port: int, threads: int, interval: float) -> None:
        self.url, self.interval, self.last_error = f"http://127.0.0.1:{port}/metrics", interval, ""
        self.stop = threading.Event()
        self.latencies: List[float] = []  # list.append is atomic: no lock needed
        self.errors: List[float] = []  # times of failed scrapes after the first success
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=10) as resp:
                    ok = resp.status == 200 and b"elasticrun_world_size" in resp.read()
            except OSError as err:
                ok = False
                self.last_error = repr(err)
            if ok:
                self.latencies.append(time.perf_counter() - t0)
                self.stop.wait(self.interval)
            else:
                if self.latencies:  # refused before the server is up: not an error
                    self.errors.append(time.time())
                time.sleep(0.05)  # the server is not up yet (or gone): do not spin

    def __enter__(self) -> Storm:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(15)


def one_run(args: argparse.Namespace, storm: bool, workdir: Path, index: int) -> Dict[str, Any]:
    """One job, quiet or under a storm of scrapes: its step rate and median step time, the agent's CPU
    seconds, and the scrapes' count, latency and errors."""
    port = free_port()
    log = workdir / f"steps-{index}.jsonl"
    agents = Agents()
    proc = agents.start("agent", [sys.executable, "-m", "elasticrun", "--standalone", "--nproc-per-node",
                                  str(args.nproc), "-q", "--metrics-port", str(port), str(TRAIN), "--steps",
                                  str(args.steps), "--no-checkpoint", "--metrics-log", str(log),
                                  "--dataset-size", "100000"])
    scrapes: Dict[str, Any] = {}
    try:
        if storm:
            scraper_cpu = time.process_time()
            with Storm(port, args.threads, args.interval) as s:
                cpu = _wait_cpu(proc, args.timeout)
            scrapes["scraper_cpu_s"] = round(time.process_time() - scraper_cpu, 2)  # this process: the scrapers
            lat = sorted(s.latencies)
            scrapes.update(scrapes=len(lat), p50_ms=round(1000 * lat[len(lat) // 2], 2) if lat else None,
                           p99_ms=round(1000 * lat[int(len(lat) * 0.99)], 2) if lat else None)
        else:
            cpu = _wait_cpu(proc, args.timeout)
    finally:
        agents.close()
    if proc.returncode != 0:
        tail = "\n".join(ln.text for ln in agents.lines()[-20:])
        raise SystemExit(f"bench_metrics: run {index} failed (exit {proc.returncode}): {tail}")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    if storm:  # failed scrapes while the job trained (the agent's server closes just before it exits)
        scrapes["errors"] = sum(1 for t in s.errors if t <= rows[-1]["time"])
        if scrapes["errors"]:
            scrapes["last_error"] = s.last_error
    rows = [r for r in rows if r["step"] >= args.skip]
    gaps = sorted(b["time"] - a["time"] for a, b in zip(rows, rows[1:]))
    rate = (rows[-1]["step"] - rows[0]["step"]) / (rows[-1]["time"] - rows[0]["time"])
    return {"storm": storm, "steps_per_s": round(rate, 3), "median_step_ms": round(1000 * gaps[len(gaps) // 2], 3),
            "agent_cpu_s": cpu, **scrapes}


def _wait_cpu(proc: subprocess.Popen, timeout: float) -> float:
    """Wait for the agent; its own CPU seconds (user + system, sampled until just before it exits)."""
    agent = psutil.Process(proc.pid)
    cpu = 0.0
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            t = agent.cpu_times()
            cpu = t.user + t.system
        except psutil.Error:
            break
        time.sleep(0.1)
    proc.wait(max(1.0, deadline - time.monotonic()))
    return round(cpu, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="pairs of runs (quiet, storm)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--skip", type=int, default=10, help="steps excluded at the start of each run")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=50, help="concurrent scrapers during a storm run")
    ap.add_argument("--interval", type=float, default=0.0,
                    help="seconds each scraper waits between scrapes (0: back to back, the worst case)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    ap.add_argument("--json", default="", help="write the results to this file")
    args = ap.parse_args()
    results: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        for _ in range(args.runs):
            for storm in (False, True):
                r = one_run(args, storm, Path(tmp), len(results))
                results.append(r)
                print(json.dumps(r), flush=True)
    quiet = statistics.median(r["median_step_ms"] for r in results if not r["storm"])
    stormy = statistics.median(r["median_step_ms"] for r in results if r["storm"])
    how = f"every {args.interval:g} s" if args.interval else "back to back"
    row = summary_row(f"median step time, {args.nproc} workers, {args.threads} scrapers {how}", stormy, "no scrapes",
                      quiet, "ms", command=shown_command(__file__))
    summary = {"summary": [row],
               "quiet_median_step_ms": quiet, "storm_median_step_ms": stormy,
               "slowdown_pct": round(100 * (stormy / quiet - 1), 1), "threads": args.threads,
               "interval": args.interval, "nproc": args.nproc, "steps": args.steps, "runs": results,
               "scrape_errors": sum(r.get("errors", 0) for r in results)}
    print(f"median step: {quiet:.2f} ms without, {stormy:.2f} ms with {args.threads} scrapers "
          f"({summary['slowdown_pct']:+.1f}%); scrapes {sum(r.get('scrapes', 0) for r in results)}, "
          f"errors while training {summary['scrape_errors']}")
    if args.json:
        write_json(args.json, summary)


if __name__ == "__main__":
    main()
