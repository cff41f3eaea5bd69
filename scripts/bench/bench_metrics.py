"""Does a scrape storm on the agent's /metrics slow training? Step time with and without one.

    python scripts/bench/bench_metrics.py                                  # 3 pairs, 200 steps, 50 scrapers
    python scripts/bench/bench_metrics.py --runs 1 --steps 60 --threads 10 # a small version (~1 min)
    python scripts/bench/bench_metrics.py --interval 1                     # 50 scrapes/s (Prometheus: 1 per 15 s)

Real jobs of examples/train.py, quiet and storm runs alternating; rank 0's median step time from step 10 on, the
scrapes' count, errors and latency, the agent's CPU seconds (docs/performance.md, "Metrics endpoint").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Iterator, List

import psutil
from common import TRAIN, Agents, shown_command, summary_row, write_json

from elasticrun.store.server import free_port

NPROC, SKIP, TIMEOUT = 2, 10, 300.0  # workers; steps left out at the start of a run; seconds a run may take


@contextlib.contextmanager
def storm(port: int, threads: int, interval: float) -> Iterator[SimpleNamespace]:
    """``threads`` scrapers hitting the agent's /metrics until the block ends; their latencies, the times of failed
    scrapes after the first success, and the last error."""
    out, stop = SimpleNamespace(latencies=[], errors=[], last_error=""), threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
                    ok = resp.status == 200 and b"elasticrun_world_size" in resp.read()
            except OSError as err:
                ok, out.last_error = False, repr(err)
            if ok:
                out.latencies.append(time.perf_counter() - t0)  # list.append is atomic: no lock needed
                stop.wait(interval)
                continue
            if out.latencies:  # refused before the server is up: not an error
                out.errors.append(time.time())
            time.sleep(0.05)  # the server is not up yet (or gone): do not spin

    pool = [threading.Thread(target=scrape, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    try:
        yield out
    finally:
        stop.set()
        for t in pool:
            t.join(15)


def one_run(args: argparse.Namespace, stormy: bool, log: Path) -> Dict[str, Any]:
    """One job, quiet or under a storm of scrapes: its step rate and median step time, the agent's CPU
    seconds (sampled until just before it exits), and the scrapes' count, latency and errors."""
    port = free_port()
    agents = Agents()
    proc = agents.start("agent", [sys.executable, "-m", "elasticrun", "--standalone", "--nproc-per-node", str(NPROC),
                                  "-q", "--metrics-port", str(port), str(TRAIN), "--steps", str(args.steps),
                                  "--no-checkpoint", "--metrics-log", str(log), "--dataset-size", "100000"])
    agent, scraper_cpu, cpu, deadline = psutil.Process(proc.pid), time.process_time(), 0.0, time.monotonic() + TIMEOUT
    try:
        with storm(port, args.threads if stormy else 0, args.interval) as s:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    t = agent.cpu_times()
                except psutil.Error:
                    break
                cpu = t.user + t.system
                time.sleep(0.1)
            proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        agents.close()
    if proc.returncode != 0:
        tail = "\n".join(ln.text for ln in agents.lines()[-20:])
        raise SystemExit(f"bench_metrics: {log.stem} failed (exit {proc.returncode}): {tail}")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    scrapes: Dict[str, Any] = {}
    if stormy:
        lat = sorted(s.latencies)
        scrapes.update(scraper_cpu_s=round(time.process_time() - scraper_cpu, 2), scrapes=len(lat),
                       p50_ms=round(1000 * lat[len(lat) // 2], 2) if lat else None,
                       p99_ms=round(1000 * lat[int(len(lat) * 0.99)], 2) if lat else None,
                       # failed scrapes while the job trained (the agent's server closes just before it exits)
                       errors=sum(1 for t in s.errors if t <= rows[-1]["time"]))
        if scrapes["errors"]:
            scrapes["last_error"] = s.last_error
    rows = [r for r in rows if r["step"] >= SKIP]
    gaps = sorted(b["time"] - a["time"] for a, b in zip(rows, rows[1:]))
    rate = (rows[-1]["step"] - rows[0]["step"]) / (rows[-1]["time"] - rows[0]["time"])
    return {"storm": stormy, "steps_per_s": round(rate, 3), "median_step_ms": round(1000 * gaps[len(gaps) // 2], 3),
            "agent_cpu_s": round(cpu, 2), **scrapes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="pairs of runs (quiet, storm)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=50, help="concurrent scrapers during a storm run")
    ap.add_argument("--interval", type=float, default=0.0,
                    help="seconds each scraper waits between scrapes (0: back to back, the worst case)")
    ap.add_argument("--json", default="", help="write the results to this file")
    args = ap.parse_args()
    results: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        for i in range(2 * args.runs):
            results.append(one_run(args, i % 2 == 1, Path(tmp) / f"run-{i}.jsonl"))
            print(json.dumps(results[-1]), flush=True)
    quiet = statistics.median(r["median_step_ms"] for r in results if not r["storm"])
    loud = statistics.median(r["median_step_ms"] for r in results if r["storm"])
    how = f"every {args.interval:g} s" if args.interval else "back to back"
    row = summary_row(f"median step time, {NPROC} workers, {args.threads} scrapers {how}", loud, "no scrapes",
                      quiet, "ms", command=shown_command(__file__))
    summary = {"summary": [row], "quiet_median_step_ms": quiet, "storm_median_step_ms": loud,
               "slowdown_pct": round(100 * (loud / quiet - 1), 1), "threads": args.threads,
               "interval": args.interval, "nproc": NPROC, "steps": args.steps, "runs": results,
               "scrape_errors": sum(r.get("errors", 0) for r in results)}
    print(f"median step: {quiet:.2f} ms without, {loud:.2f} ms with {args.threads} scrapers "
          f"({summary['slowdown_pct']:+.1f}%); scrapes {sum(r.get('scrapes', 0) for r in results)}, "
          f"errors while training {summary['scrape_errors']}")
    write_json(args.json, summary)


if __name__ == "__main__":
    main()
