#!/usr/bin/env python
"""Run every benchmark of this folder (its ``bench_*.py``) with one preset, each with its JSON into one output dir.

    python scripts/bench/run_all.py --out /tmp/perf                      # preset "quick" (~30 min, 2 cores)
    python scripts/bench/run_all.py --out /tmp/perf --preset full        # the figures of docs/performance.md
    python scripts/bench/run_all.py --out $OUT/perf --device cuda --budget 420   # a lent GPU machine
    python scripts/perf/perf_report.py /tmp/perf                          # charts + the page's summary table

Each bench runs in its own process session under a time limit (cut to what is left of ``--budget``); one that
fails, runs out of time or is skipped is recorded in ``bench_all.json`` and the next one starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SHOWN = HERE.relative_to(ROOT).as_posix()  # scripts/bench, as commands are shown
MANIFEST = "bench_all.json"
TAKES_DEVICE = {"bench_checkpoint.py", "bench_launch.py", "bench_snapshot.py"}  # the others measure CPU-side work
OUT_OPTION = {"bench_rendezvous.py": "--out"}  # where a bench takes the path of its JSON, when not --json


class Status(str, Enum):
    """What became of one benchmark run."""

    OK = "ok"
    FAILED = "failed"
    TIMEOUT = "timeout"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Spec:
    """One benchmark invocation: ``name`` is also the stem of its JSON file in the output dir."""

    name: str
    script: str
    args: Sequence[str]
    timeout_s: float


# Each preset's benches: (name, script, its arguments, seconds it may take). ``quick`` keeps every bench to a few
# minutes on 2 cores; ``full`` gives the figures of docs/performance.md; ``gpu``: a lent GPU host (16 cores), what
# the device changes first, ~6 min in all. bench_checkpoint.py also gets ``--dir SCRATCH``.
PRESETS: Dict[str, List[Tuple[str, str, str, float]]] = {
    "quick": [
        ("launch", "bench_launch.py", "--scenarios launch,launch-multi --runs 3 --nodes 2 --procs 2 --timeout 40", 600),
        ("restart", "bench_launch.py", "--scenarios restart --crash-after 0.2,1,3 --launchers elasticrun,torchrun-best "
                                       "--runs 3 --nodes 2 --procs 2 --timeout 40", 900),
        ("elastic", "bench_elastic.py", "--runs 2 --quick --timeout 60", 420),
        ("elastic-join3", "bench_elastic.py", "--scenario join --quick --nodes 3 --nproc 1 --client plain bench "
                                              "example --runs 2 --timeout 60", 480),
        ("checkpoint-0.1", "bench_checkpoint.py", "--state gpt --size-gib 0.1 --repeat 7 --settle 0.3", 300),
        ("checkpoint-0.4", "bench_checkpoint.py", "--state gpt --size-gib 0.4 --repeat 7 --settle 0.3", 300),
        ("rendezvous", "bench_rendezvous.py", "--clients shared --nodes 8 32 128 256 512 --runs 1 --phases", 300),
        ("snapshot", "bench_snapshot.py", "--mb 256 --repeat 3", 300),
        ("snapshot-lost", "bench_snapshot.py", "--parts lost", 720),
        ("metrics", "bench_metrics.py", "--runs 1 --steps 120 --interval 1", 300),
        ("preemption", "bench_preemption.py", "--runs 3 --state-gb 0.05 --max-delay 3", 300),
        ("stragglers-slow", "bench_stragglers.py", "--minutes 2 --slow", 480),
    ],
    "full": [
        ("launch", "bench_launch.py", "--runs 5 --nodes 2 --procs 2 --timeout 45", 1800),
        ("elastic", "bench_elastic.py", "--runs 3 --timeout 90", 2700),
        ("elastic-join3", "bench_elastic.py", "--scenario join --quick --nodes 3 --nproc 1 --client plain bench "
                                              "example --runs 3", 1500),
        ("checkpoint-0.25", "bench_checkpoint.py", "--state gpt --size-gib 0.25 --repeat 5", 1500),
        ("checkpoint-1", "bench_checkpoint.py", "--state gpt --size-gib 1 --repeat 5", 1500),
        ("checkpoint-2", "bench_checkpoint.py", "--state gpt --size-gib 2 --repeat 5", 1500),
        ("checkpoint-1-uniform", "bench_checkpoint.py", "--size-gib 1 --repeat 5", 2400),
        ("rendezvous", "bench_rendezvous.py", "--clients shared --runs 3", 900),
        ("snapshot", "bench_snapshot.py", "--mb 1024 --repeat 5 --parts stall,restore,lost", 1800),
        ("metrics", "bench_metrics.py", "--runs 3 --interval 1", 900),
        ("metrics-storm", "bench_metrics.py", "--runs 3", 900),
        ("preemption", "bench_preemption.py", "--runs 20 --state-gb 0.4 --notice 30 --max-delay 10", 1800),
        ("stragglers", "bench_stragglers.py", "--minutes 10", 1200),
        ("stragglers-slow", "bench_stragglers.py", "--minutes 3 --slow", 600),
    ],
    "gpu": [
        ("checkpoint-2", "bench_checkpoint.py", "--state gpt --size-gib 2 --repeat 3 --settle 0.3", 200),
        ("snapshot", "bench_snapshot.py", "--mb 1024 --repeat 2", 110),
        ("launch", "bench_launch.py", "--runs 1 --nodes 1 --procs 1 --scenarios launch,restart --timeout 40", 150),
        ("rendezvous", "bench_rendezvous.py", "--clients shared --nodes 8 32 128 256 --runs 1", 90),
    ],
}


def _specs(preset: str, scratch: str) -> List[Spec]:
    """The invocations of a preset; bench_checkpoint.py writes its files under ``scratch`` when given."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}")
    specs = []
    for name, script, args, timeout_s in PRESETS[preset]:
        disk = ["--dir", scratch] if scratch and script == "bench_checkpoint.py" else []
        specs.append(Spec(name, script, [*args.split(), *disk], timeout_s))
    return specs


@dataclass
class Result:
    """One row of the manifest."""

    name: str
    script: str
    command: str
    status: Status
    seconds: float = 0.0
    returncode: Optional[int] = None
    json: Optional[str] = None
    log: Optional[str] = None
    notes: List[str] = field(default_factory=list)


def _stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the bench's process group (benches clean their children up), then SIGKILL it."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return


def run_one(spec: Spec, out: Path, device: str, python: str, limit_s: float) -> Result:
    """Run one bench under ``limit_s``; its output goes to ``<name>.log``, its JSON to ``<name>.json``."""
    script = HERE / spec.script
    args, notes = list(spec.args), []
    if device != "cpu":
        if script.name in TAKES_DEVICE:
            args += ["--device", device]
        else:
            notes.append(f"takes no --device: run unchanged (it measures CPU-side work, not the {device})")
    json_path = out / f"{spec.name}.json"
    json_path.unlink(missing_ok=True)  # an earlier run's file is not this run's result
    args += [OUT_OPTION.get(script.name, "--json"), str(json_path)]
    cmd = [python, str(script), *args]
    shown = " ".join(shlex.quote(a) for a in ["python", f"{SHOWN}/{spec.script}", *args])
    log = out / f"{spec.name}.log"
    path = os.pathsep.join([os.path.dirname(python), os.environ.get("PATH", "")])  # the env's elasticrun, torchrun
    env = dict(os.environ, PATH=path, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        try:
            rc: Optional[int] = proc.wait(limit_s)
            status = Status.OK if rc == 0 else Status.FAILED
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc, status = proc.returncode, Status.TIMEOUT
            notes.append(f"stopped after {limit_s:.0f} s")
        except BaseException:
            _stop(proc, grace=5.0)
            raise
    res = Result(spec.name, spec.script, shown, status, round(time.monotonic() - t0, 1), rc, log=log.name, notes=notes)
    if json_path.exists():
        res.json = json_path.name
    elif status is Status.OK:
        res.status = Status.FAILED
        res.notes.append("no JSON written")
    if res.status is not Status.OK:
        tail = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:]
        res.notes += [f"last line: {tail[0][:200]}"] if tail else []
    return res


def host_info() -> Dict[str, object]:
    """The machine the run was taken on (for the page's header)."""
    info: Dict[str, object] = {"cpus": os.cpu_count(), "loadavg_start": [round(x, 2) for x in os.getloadavg()],
                               "python": sys.version.split()[0]}
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            info["mem_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    return info


def _write_manifest(out: Path, head: Dict[str, object], results: List[Result], order: List[str]) -> None:
    results = sorted(results, key=lambda r: order.index(r.name) if r.name in order else len(order))
    rows = [dict(asdict(r), status=r.status.value) for r in results]
    (out / MANIFEST).write_text(json.dumps(dict(head, benches=rows), indent=1))


def _earlier(out: Path, head: Dict[str, object], rerun: set, preset: set) -> List[Result]:
    """The manifest rows of the preset's benches not run now, when ``out`` holds a run of the same
    preset and device (a rerun of some benches with ``--only`` updates that run in place); else none."""
    try:
        old = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(old, dict) or (old.get("preset"), old.get("device")) != (head["preset"], head["device"]):
        return []
    head["started"] = old.get("started", head["started"])
    head["host"] = old.get("host", head["host"])
    rows = []
    for r in old.get("benches", []):
        try:
            if r["name"] not in rerun and r["name"] in preset:
                rows.append(Result(**dict(r, status=Status(r["status"]))))
        except (KeyError, TypeError, ValueError):
            continue
    return rows


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output dir: <bench>.json, <bench>.log, bench_all.json")
    ap.add_argument("--preset", choices=["quick", "full", "gpu"], default="quick",
                    help="quick: ~30 min on 2 cores; full: more runs and sizes (hours); gpu: ~6 min on a GPU host")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="passed to the benches that take it")
    ap.add_argument("--only", default="", help="comma-separated bench names (e.g. launch,checkpoint-0.1)")
    ap.add_argument("--budget", type=float, default=0.0, help="seconds for the whole run (0: no bound)")
    ap.add_argument("--min-slot", type=float, default=60.0, help="skip a bench when less than this is left")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every per-bench limit")
    ap.add_argument("--scratch", default="/var/tmp" if os.path.isdir("/var/tmp") else "",
                    help="disk dir for checkpoint files [/var/tmp: a real disk, unlike a tmpfs /tmp]")
    ap.add_argument("--list", action="store_true", help="print the preset's benches and exit")
    return ap.parse_args(argv)


def selected(args: argparse.Namespace, specs: List[Spec]) -> List[Spec]:
    """The preset's benches ``--only`` names, in that order (all without it); ValueError for an unknown name."""
    names = [s.name for s in specs]
    only = [n for n in args.only.split(",") if n]
    unknown = sorted(set(only) - set(names))
    if unknown:
        raise ValueError(f"unknown bench name(s) {unknown}; choose from {sorted(names)}")
    return [next(s for s in specs if s.name == n) for n in only] if only else specs


def run_specs(args: argparse.Namespace, specs: List[Spec], head: Dict[str, object], earlier: List[Result],
              order: List[str]) -> List[Result]:
    """Run each bench within its limit and what is left of ``--budget``, the manifest rewritten after each one."""
    deadline = time.monotonic() + args.budget if args.budget > 0 else None
    results: List[Result] = []
    for spec in specs:
        limit = spec.timeout_s * args.timeout_scale
        left = deadline - time.monotonic() if deadline is not None else limit
        if deadline is not None and left < args.min_slot:
            results.append(Result(spec.name, spec.script, "", Status.SKIPPED,
                                  notes=[f"budget: {max(left, 0):.0f} s left"]))
            print(f"[run_all] {spec.name}: skipped (budget)", flush=True)
            continue
        limit = min(limit, left)
        print(f"[run_all] {spec.name}: {SHOWN}/{spec.script} (limit {limit:.0f} s)", flush=True)
        try:
            res = run_one(spec, args.out, args.device, sys.executable, limit)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the bench's group is stopped; keep what was measured
            results.append(Result(spec.name, spec.script, "", Status.FAILED, notes=["interrupted"]))
            _write_manifest(args.out, head, earlier + results, order)
            raise
        results.append(res)
        print(f"[run_all] {spec.name}: {res.status.value} in {res.seconds:.0f} s"
              + (f" ({'; '.join(res.notes)})" if res.notes else ""), flush=True)
        _write_manifest(args.out, head, earlier + results, order)
    return results


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a running bench is stopped (its group) first
    preset = _specs(args.preset, args.scratch)
    order = [s.name for s in preset]  # the preset's order: also the manifest's, after a partial rerun
    try:
        specs = selected(args, preset)
    except ValueError as e:
        print(f"run_all: {e}", file=sys.stderr)
        return 2
    if args.list:
        for s in specs:
            print(f"{s.name:18s} {s.timeout_s:6.0f} s  {SHOWN}/{s.script} {' '.join(s.args)}")
        return 0
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"run_all: cannot create the output dir {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    known = {s.script for p in ("quick", "full", "gpu") for s in _specs(p, "")}
    for extra in sorted(p.name for p in HERE.glob("bench_*.py") if p.name not in known):
        print(f"run_all: warning: {SHOWN}/{extra} is not in any preset; add it to run_all.py", file=sys.stderr)
    head: Dict[str, object] = {"preset": args.preset, "device": args.device, "started": time.time(),
                               "host": host_info()}
    earlier = _earlier(args.out, head, {s.name for s in specs}, set(order))
    try:
        results = run_specs(args, specs, head, earlier, order)
    except KeyboardInterrupt:
        print(f"[run_all] interrupted; results so far in {args.out}", file=sys.stderr)
        return 130
    head.update(finished=time.time(), loadavg_end=[round(x, 2) for x in os.getloadavg()])
    _write_manifest(args.out, head, earlier + results, order)
    bad = [r.name for r in results if r.status in (Status.FAILED, Status.TIMEOUT)]
    print(f"[run_all] done: {len(results) - len(bad)}/{len(results)} ok; results in {args.out}"
          + (f"; failed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
