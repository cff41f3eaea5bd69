"""Run every benchmark of this folder (its ``bench_*.py``) with one preset, each with its JSON into one output dir.

    python scripts/bench/run_all.py --out /tmp/perf                      # preset "quick" (~30 min, 2 cores)
    python scripts/bench/run_all.py --out /tmp/perf --preset full        # the figures of docs/performance.md
    python scripts/bench/run_all.py --out $OUT/perf --device cuda --budget 420   # a lent GPU machine
    python scripts/perf/perf_report.py /tmp/perf                          # charts + the page's summary table

Each bench runs in its own process session under a time limit (cut to what is left of ``--budget``); what became
of each is recorded in ``bench_all.json``.
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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SHOWN = HERE.relative_to(ROOT).as_posix()  # scripts/bench, as commands are shown
MANIFEST = "bench_all.json"
TAKES_DEVICE = {"bench_checkpoint.py", "bench_launch.py", "bench_snapshot.py"}  # the others measure CPU-side work
OUT_OPTION = {"bench_rendezvous.py": "--out"}  # where a bench takes the path of its JSON, when not --json


@dataclass(frozen=True)
class Spec:
    """One benchmark invocation: ``name`` is also the stem of its JSON file in the output dir."""

    name: str
    script: str
    args: Sequence[str]
    timeout_s: float


JOIN3 = "--scenario join --quick --nodes 3 --nproc 1 --client plain bench example"  # a 2 x 1 job grows to 3 x 1
# Each preset's benches: (name, script, its arguments, seconds it may take); ``gpu``: what a lent GPU host (16
# cores) changes first, ~6 min in all. bench_checkpoint.py also gets ``--dir SCRATCH``.
PRESETS: Dict[str, List[Tuple[str, str, str, float]]] = {
    "quick": [
        ("launch", "bench_launch.py", "--scenarios launch,launch-multi --runs 3 --nodes 2 --procs 2 --timeout 40", 600),
        ("restart", "bench_launch.py", "--scenarios restart --crash-after 0.2,1,3 --launchers elasticrun,torchrun-best "
                                       "--runs 3 --nodes 2 --procs 2 --timeout 40", 900),
        ("elastic", "bench_elastic.py", "--runs 2 --quick --timeout 60", 420),
        ("elastic-join3", "bench_elastic.py", f"{JOIN3} --runs 2 --timeout 60", 480),
        ("checkpoint-0.1", "bench_checkpoint.py", "--state gpt --size-gib 0.1 --repeat 7 --settle 0.3", 300),
        ("checkpoint-0.4", "bench_checkpoint.py", "--state gpt --size-gib 0.4 --repeat 7 --settle 0.3", 300),
        ("rendezvous", "bench_rendezvous.py", "--clients shared --nodes 8 32 128 256 512 --runs 1 --phases", 300),
        ("snapshot", "bench_snapshot.py", "--mb 256 --repeat 3", 300),
        ("snapshot-lost", "bench_snapshot.py", "--parts lost", 720),
        ("preemption", "bench_preemption.py", "--runs 3 --state-gb 0.05 --max-delay 3", 300),
        ("stragglers-slow", "bench_stragglers.py", "--minutes 2 --slow --hidden 16384 --batch-size 32", 480),
    ],
    "full": [
        ("launch", "bench_launch.py", "--runs 5 --nodes 2 --procs 2 --timeout 45", 1800),
        ("elastic", "bench_elastic.py", "--runs 3 --timeout 90", 2700),
        ("elastic-join3", "bench_elastic.py", f"{JOIN3} --runs 3", 1500),
        ("checkpoint-0.25", "bench_checkpoint.py", "--state gpt --size-gib 0.25 --repeat 5", 1500),
        ("checkpoint-1", "bench_checkpoint.py", "--state gpt --size-gib 1 --repeat 5", 1500),
        ("checkpoint-2", "bench_checkpoint.py", "--state gpt --size-gib 2 --repeat 5", 1500),
        ("checkpoint-1-uniform", "bench_checkpoint.py", "--size-gib 1 --repeat 5", 2400),
        ("rendezvous", "bench_rendezvous.py", "--clients shared --runs 3", 900),
        ("snapshot", "bench_snapshot.py", "--mb 1024 --repeat 5 --parts stall,restore,lost", 1800),
        ("preemption", "bench_preemption.py", "--runs 20 --state-gb 0.4 --notice 30 --max-delay 10", 1800),
        ("stragglers", "bench_stragglers.py", "--minutes 10", 1200),
        ("stragglers-slow", "bench_stragglers.py", "--minutes 3 --slow --hidden 16384 --batch-size 32", 600),
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
    disk = ["--dir", scratch] if scratch else []
    return [Spec(name, script, [*args.split(), *(disk if script == "bench_checkpoint.py" else [])], timeout_s)
            for name, script, args, timeout_s in PRESETS[preset]]


class Status(str, Enum):
    """What became of one benchmark run."""

    OK, FAILED, TIMEOUT, SKIPPED = "ok", "failed", "timeout", "skipped"


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
    shown = shlex.join(["python", f"{SHOWN}/{spec.script}", *args])
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
                               "python": sys.version.split()[0],
                               "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        info["cpu"] = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    return info


def _write_manifest(out: Path, head: Dict[str, object], results: List[Result], order: List[str]) -> None:
    results = sorted(results, key=lambda r: order.index(r.name))  # the preset's order, after a partial rerun too
    (out / MANIFEST).write_text(json.dumps(dict(head, benches=[asdict(r) for r in results]), indent=1))


def _earlier(out: Path, head: Dict[str, object], rerun: set, preset: set) -> List[Result]:
    """The manifest rows of the preset's benches not run now, when ``out`` holds a run of the same
    preset and device (a rerun of some benches with ``--only`` updates that run in place); else none."""
    try:
        old = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return []
    if (old["preset"], old["device"]) != (head["preset"], head["device"]):
        return []
    head.update(started=old["started"], host=old["host"])
    return [Result(**dict(r, status=Status(r["status"]))) for r in old["benches"]
            if r["name"] not in rerun and r["name"] in preset]


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
    ap.add_argument("--list", action="store_true", help="print the preset's benches and exit")
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a running bench is stopped (its group) first
    scratch = "/var/tmp" if os.path.isdir("/var/tmp") else ""  # checkpoint files on a real disk, not a tmpfs /tmp
    preset = {s.name: s for s in _specs(args.preset, scratch)}
    only = [n for n in args.only.split(",") if n]
    if set(only) - set(preset):
        print(f"run_all: unknown bench name(s) {sorted(set(only) - set(preset))}; choose from {sorted(preset)}",
              file=sys.stderr)
        return 2
    specs, order = [preset[n] for n in only or preset], list(preset)
    if args.list:
        for s in specs:
            print(f"{s.name:18s} {s.timeout_s:6.0f} s  {SHOWN}/{s.script} {' '.join(s.args)}")
        return 0
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"run_all: cannot create the output dir {args.out}: {e.strerror}", file=sys.stderr)
        return 2
    head: Dict[str, object] = {"preset": args.preset, "device": args.device, "started": time.time(),
                               "host": host_info()}
    earlier = _earlier(args.out, head, {s.name for s in specs}, set(order))
    results: List[Result] = []
    try:
        run_all(specs, args, results, lambda: _write_manifest(args.out, head, earlier + results, order))
        head.update(finished=time.time(), loadavg_end=[round(x, 2) for x in os.getloadavg()])
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the bench's group was stopped; keep what was measured
        print(f"[run_all] interrupted; results so far in {args.out}", file=sys.stderr)
        return 130
    finally:
        _write_manifest(args.out, head, earlier + results, order)
    bad = [r.name for r in results if r.status in (Status.FAILED, Status.TIMEOUT)]
    print(f"[run_all] done: {len(results) - len(bad)}/{len(results)} ok; results in {args.out}"
          + (f"; failed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


def run_all(specs: List[Spec], args: argparse.Namespace, results: List[Result], save: Callable[[], None]) -> None:
    """Run ``specs`` in turn into ``results`` (``save()`` after each) within ``--budget``, or skip them."""
    deadline = time.monotonic() + args.budget if args.budget > 0 else float("inf")
    for spec in specs:
        left = deadline - time.monotonic()
        if left < args.min_slot:
            notes = [f"budget: {max(left, 0):.0f} s left"]
            results.append(Result(spec.name, spec.script, "", Status.SKIPPED, notes=notes))
            print(f"[run_all] {spec.name}: skipped (budget)", flush=True)
            continue
        limit = min(spec.timeout_s * args.timeout_scale, left)
        print(f"[run_all] {spec.name}: {SHOWN}/{spec.script} (limit {limit:.0f} s)", flush=True)
        results.append(Result(spec.name, spec.script, "", Status.FAILED, notes=["interrupted"]))  # until it returns
        results[-1] = res = run_one(spec, args.out, args.device, sys.executable, limit)
        print(f"[run_all] {spec.name}: {res.status.value} in {res.seconds:.0f} s"
              + (f" ({'; '.join(res.notes)})" if res.notes else ""), flush=True)
        save()


if __name__ == "__main__":
    sys.exit(main())
