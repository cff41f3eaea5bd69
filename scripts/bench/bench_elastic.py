"""Elastic reaction time: elasticrun against torchrun (c10d), N nodes x P procs on loopback.

    python scripts/bench/bench_elastic.py --runs 1 --quick
    python scripts/bench/bench_elastic.py --runs 3 --scenario all --launcher all
    python scripts/bench/bench_elastic.py --scenario crash --quick --nodes 3 --nproc 1 --client inplace bench

Scenarios (docs/performance.md): ``kill`` (SIGKILL to the last node's agent and all under it), ``join`` (the last
node starts), ``leave`` (SIGTERM to the last node's agent), ``kill-host`` (``kill`` of node A, the rendezvous host),
``crash`` (SIGKILL to the last rank's worker), each timed to the first step at the new world size, with ``phases``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import common
from common import STEP, TORCHRUN_TUNED_CONF, TRAIN, Agents, AgentsExited, shown_command, summary_row, write_json

from elasticrun.store.server import EtcdServer, free_port

STABILITY_WINDOW = 1.0
EXAMPLE_RE = re.compile(r"(?:^|\]:)step (\d+) loss \S+ world (\d+)")  # examples/train.py's: timed when read
CLIENTS = ["bench", "example", "inplace", "plain"]  # elastic_worker.py's modes and examples/train.py
Step = Tuple[int, int, float]  # (step, world size, unix time)
MEMBERS_TOLD = "(3 members;"  # an agent's line once it was told the job's etcd has 3 members


def client_argv(client: str, out_dir: Path) -> List[str]:
    """The training script of ``--client`` and its arguments."""
    if client == "example":
        return [str(TRAIN), "--epochs", "1000000", "--ckpt-dir", str(out_dir / "ckpt"), "--ckpt-every", "0",
                "--step-sleep", "0.05"]
    return [str(Path(__file__).resolve().with_name("elastic_worker.py")), client, str(out_dir)]


def parse_step(line: str, read_at: float) -> Optional[Step]:
    """The step that one output line reports (None: none)."""
    m = STEP.search(line) or EXAMPLE_RE.search(line)
    return None if m is None else (int(m[1]), int(m[2]), float(m[3]) if m.re is STEP else read_at)


@dataclass(frozen=True)
class Variant:
    """One launcher configuration under test."""

    launcher: str  # "elasticrun" or "torchrun"
    label: str
    heartbeat: float = 5.0  # elasticrun --heartbeat-timeout
    prewarm: bool = True  # elasticrun --prewarm / --no-prewarm
    tuned: bool = False  # torchrun: tuned timeouts + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    inplace: bool = True  # elasticrun: --inplace / --no-inplace (matters for the ``inplace`` client)
    hosted: bool = False  # elasticrun on torchrun's c10d line: node A hosts the job's etcd (no etcd of the bench's)
    quick: bool = False  # one of --quick's

    def target(self, scenario: str) -> Optional[float]:
        """elasticrun's target in seconds (a kill or crash: heartbeat + 2 s; else window + 2 s); None for torchrun."""
        if self.launcher != "elasticrun":
            return None
        return (self.heartbeat if scenario in ("kill", "kill-host", "crash") else STABILITY_WINDOW) + 2.0


TUNED = Variant("torchrun", "torchrun c10d tuned", tuned=True, quick=True)
JOIN = [
    Variant("elasticrun", "elasticrun sw=1 prewarm", 3.0, quick=True),
    Variant("elasticrun", "elasticrun sw=1 no-prewarm", 3.0, False),
    Variant("elasticrun", "elasticrun sw=1 prewarm no-inplace", 3.0, inplace=False, quick=True),
    Variant("torchrun", "torchrun c10d default"),
    TUNED,
]
VARIANTS: Dict[str, List[Variant]] = {
    "kill": [
        Variant("elasticrun", "elasticrun hb=3 prewarm", 3.0, quick=True),
        Variant("elasticrun", "elasticrun hb=3 no-prewarm", 3.0, False),
        Variant("elasticrun", "elasticrun hb=5 (default) prewarm", 5.0),
        Variant("elasticrun", "elasticrun hb=5 (default) no-prewarm", 5.0, False),
        Variant("torchrun", "torchrun c10d default"),
        TUNED,
    ],
    "join": JOIN,
    "leave": JOIN,
    "crash": [
        Variant("elasticrun", "elasticrun hb=3 prewarm", 3.0, quick=True),
        Variant("elasticrun", "elasticrun hb=3 prewarm no-inplace", 3.0, inplace=False),
        TUNED,
    ],
    "kill-host": [
        Variant("elasticrun", "elasticrun c10d hb=3 prewarm", 3.0, hosted=True, quick=True),
        Variant("elasticrun", "elasticrun c10d hb=5 (default) prewarm", 5.0, hosted=True),
        TUNED,
    ],
}


@dataclass
class Outcome:
    """Result of one measured run: ``ok`` with seconds, or ``hang`` / ``failed`` with a reason."""

    status: str
    seconds: Optional[float] = None
    detail: str = ""
    phases: Dict[str, float] = field(default_factory=dict)  # seconds from the change to each phase


@dataclass
class Summary:
    """All runs of one :class:`Variant` and client in one scenario."""

    scenario: str
    variant: Variant
    client: str = "bench"
    outcomes: List[Outcome] = field(default_factory=list)

    @property
    def times(self) -> List[float]:
        return [o.seconds for o in self.outcomes if o.status == "ok" and o.seconds is not None]

    def median(self) -> Optional[float]:
        return statistics.median(self.times) if self.times else None

    def phases(self) -> Dict[str, float]:
        """Median seconds to each phase over the runs that logged it."""
        names = sorted({k for o in self.outcomes for k in o.phases})
        return {k: statistics.median(o.phases[k] for o in self.outcomes if k in o.phases) for k in names}

    def as_dict(self) -> Dict[str, object]:
        return {"scenario": self.scenario, "variant": self.variant.label, "client": self.client,
                "target_s": self.variant.target(self.scenario), "median_s": self.median(),
                "outcomes": [o.__dict__ for o in self.outcomes], "phases_median_s": self.phases()}


def fmt(x: Optional[float]) -> str:
    """Seconds with one decimal, or an en dash."""
    return "–" if x is None else f"{x:.1f}"


def table(summaries: List[Summary]) -> str:
    """A markdown table: runs, median and range, failures and hangs, elasticrun's target, phases."""
    rows = []
    for s in summaries:
        t, target = s.times, s.variant.target(s.scenario)
        met = f"{target:.0f} ({sum(x <= target for x in t)}/{len(s.outcomes)})" if target is not None else "–"
        phases = ", ".join(f"{k} {v:.2f}" for k, v in s.phases().items())
        rows.append([s.scenario, s.client, s.variant.label, len(s.outcomes), fmt(s.median()),
                     f"{fmt(min(t, default=None))}–{fmt(max(t, default=None))}",
                     *(sum(o.status == k for o in s.outcomes) for k in ("failed", "hang")), met, phases])
    return common.md_table(["scenario", "client", "variant", "runs", "median s", "min–max s", "failed", "hung",
                            "target s (met)", "phases"], rows)


def summary_rows(summaries: List[Summary], command: str) -> List[Dict[str, Any]]:
    """The JSON ``summary``: each elasticrun variant's median against the best torchrun variant's."""
    rows: List[Dict[str, Any]] = []
    for s in summaries:
        alts = [(o.median(), o.variant.label) for o in summaries if (o.scenario, o.client) == (s.scenario, s.client)
                and o.variant.launcher == "torchrun" and o.median() is not None]
        if s.variant.launcher == "elasticrun" and s.median() is not None and alts:
            alt_value, alt = min(alts)
            rows.append(summary_row(f"{s.scenario} -> first step ({s.client} client, {s.variant.label})", s.median(),
                                    alt, alt_value, command=command))
    return rows


class Run:
    """One benchmark run: a fresh rendezvous (etcd or c10d port), job id, log dir and agents."""

    def __init__(self, variant: Variant, scenario: str, log_root: Path, index: int, client: str,
                 nodes: int = 2, nproc: int = 2) -> None:
        self.variant, self.scenario, self.client, self.nnodes, self.nproc = variant, scenario, client, nodes, nproc
        self.dir = log_root / re.sub(r"[^a-z0-9.]+", "-", f"{scenario}-{client}-{variant.label}-{index}".lower())
        self.dir.mkdir(parents=True, exist_ok=True)
        self.job = f"bench-{uuid.uuid4().hex[:8]}"
        self.pid_file = self.dir / f"pid-{nodes * nproc - 1}"  # the last rank's worker (elastic_worker.py writes it)
        self.agents = Agents(log_dir=self.dir, parse=parse_step)
        env = self.agents.env  # none of a job's variables that the bench itself might run under
        for name in [k for k in env if k.startswith(("ELASTICRUN_", "TORCHELASTIC_", "TORCH_DISABLE_SHARE_"))]:
            del env[name]
        env["CUDA_VISIBLE_DEVICES"] = ""  # the simulated nodes share this host: NCCL would put each on cuda:0
        if variant.tuned:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.port = free_port()
        own_etcd = variant.launcher == "elasticrun" and not variant.hosted  # else the c10d line: no etcd of ours
        self.etcd = EtcdServer(log_path=str(self.dir / "etcd.log")).start() if own_etcd else None

    def command(self, name: str) -> List[str]:
        """The agent command line for node ``name`` (A hosts the c10d store)."""
        v, host = self.variant, name == "A"
        shape = ["--nnodes", f"1:{self.nnodes}", "--nproc-per-node", str(self.nproc), "--rdzv-id", self.job,
                 "--max-restarts", "100", "--local-addr", "127.0.0.1"]
        c10d = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-conf"]
        train = client_argv(self.client, self.dir)
        if v.launcher == "torchrun":
            conf = f"{TORCHRUN_TUNED_CONF + ',' if v.tuned else ''}is_host={str(host).lower()}"
            return [sys.executable, "-m", "torch.distributed.run", *shape, *c10d, conf, *train]
        rdzv = [*c10d, f"is_host={int(host)}"] if self.etcd is None else ["--rdzv-endpoint", self.etcd.endpoint]
        return [sys.executable, "-m", "elasticrun", *shape, *rdzv, "--node-id", name,
                "--heartbeat-timeout", str(v.heartbeat), "--stability-window", str(STABILITY_WINDOW),
                "--prewarm" if v.prewarm else "--no-prewarm", "--inplace" if v.inplace else "--no-inplace", *train]

    def start(self, name: str) -> float:
        """Start node ``name``'s agent; the time it was started."""
        self.agents.start(name, self.command(name))
        return self.agents.started[name]

    def mark(self, name: str, text: str) -> Optional[float]:
        """When node ``name``'s agent first printed a line containing ``text`` (None if not yet)."""
        return next((ln.t for ln in self.agents.lines(name) if text in ln.text), None)

    def pause(self, old: int, new: Optional[int], since: float) -> Dict[str, float]:
        """The survivors' pause (their last step at world ``old`` → their first after ``since`` at world ``new``,
        None: any) and the steps redone (the step counter went back)."""
        rows = sorted((t, w, s) for (s, w, t) in self.agents.found())
        first = min(r for r in rows if r[0] >= since and new in (None, r[1]))
        last = max((r for r in rows if r[1] == old and r[0] < first[0]), default=first)
        return {"pause": round(first[0] - last[0], 3), "redone": max(0, last[2] - first[2] + 1)}

    def wait(self, check: Callable[[], Optional[float]], after: float, timeout: float, what: str) -> Outcome:
        """Wait until ``check`` returns a time; ok with the seconds from ``after`` to it, else hang or failed."""
        try:
            return Outcome("ok", self.agents.wait_for(check, timeout, what) - after)
        except TimeoutError as err:
            return Outcome("hang", None, str(err))
        except AgentsExited as err:
            return Outcome("failed", None, str(err))

    def wait_step(self, world: int, after: float, timeout: float, count: int = 1) -> Outcome:
        """Wait until ``count`` steps at ``world`` with time >= ``after`` appear in any agent's output."""

        def reached() -> Optional[float]:
            rows = sorted(t for (_, w, t) in self.agents.found() if w == world and t >= after)
            return rows[count - 1] if len(rows) >= count else None

        return self.wait(reached, after, timeout, f"a step at world size {world}")

    def members_told(self) -> Optional[float]:
        """When the last agent was told that the job's etcd has 3 members (None before every one was)."""
        marks = [self.mark(n, MEMBERS_TOLD) for n in self.agents.procs]
        return None if None in marks else max(marks)

    def close(self) -> None:
        """Kill every process of this run and stop etcd."""
        self.agents.close()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None


def steady(run: Run, names: List[str], timeout: float, warm_steps: int) -> Outcome:
    """Start the scenario's first nodes, wait for ``warm_steps`` steps and what its change needs; ok, or why not."""
    joins, full = run.scenario == "join", run.nnodes * run.nproc
    for name in names[:-1] if joins else names:
        run.start(name)
    ready = run.wait_step(full - run.nproc if joins else full, 0.0, timeout, count=warm_steps)
    if ready.status == "ok" and run.scenario == "kill-host" and run.variant.hosted:
        ready = run.wait(run.members_told, run.agents.started["A"], timeout, "the job's etcd to have 3 members")
        ready.phases["members"] = round(ready.seconds or 0.0, 3)
    if ready.status == "ok" and run.scenario == "crash" and not run.pid_file.exists():
        ready = Outcome("failed", None, f"{run.client} wrote no {run.pid_file.name}: use --client bench or inplace")
    return ready


def measure(run: Run, timeout: float, warm_steps: int) -> Outcome:
    """Set the scenario up (a steady job), cause the change, and time the first step at the new world size."""
    names = [chr(ord("A") + i) for i in range(run.nnodes)]
    full, less, joins = run.nnodes * run.nproc, (run.nnodes - 1) * run.nproc, run.scenario == "join"
    ready = steady(run, names, timeout, warm_steps)
    if ready.status != "ok":
        return Outcome(ready.status, None, "setup: " + ready.detail)
    old, new = (less, full) if joins else (full, full if run.scenario == "crash" else less)
    if joins:
        at = run.start(names[-1])
    elif run.scenario == "leave":
        at = run.agents.kill(names[-1], signal.SIGTERM)
    elif run.scenario == "crash":
        at = time.time()
        os.kill(int(run.pid_file.read_text()), signal.SIGKILL)
    else:
        at = run.agents.kill(names[0] if run.scenario == "kill-host" else names[-1])
    outcome = run.wait_step(new, at, timeout)
    outcome.phases.update(ready.phases)
    for phase, text in (("joined", "joined job"), ("round", "(ScaleUp): world size")) if joins else ():
        mark = run.mark(names[-1], text)
        if mark is not None:
            outcome.phases[phase] = round(mark - at, 3)
    if outcome.status == "ok":  # crash: the survivors' first step may come at a smaller world size
        outcome.phases.update(run.pause(old, None if run.scenario == "crash" else new, at))
    return outcome


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per variant and scenario")
    ap.add_argument("--scenario", choices=[*VARIANTS, "all"], default="all", help="all: kill, join, leave")
    ap.add_argument("--launcher", choices=["elasticrun", "torchrun", "all"], default="all")
    ap.add_argument("--quick", action="store_true", help="only elasticrun hb=3/sw=1 prewarm and tuned torchrun")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per phase before a run counts as hung")
    ap.add_argument("--warm-steps", type=int, default=5, help="steps of a steady job before the change")
    ap.add_argument("--client", nargs="+", choices=CLIENTS, default=["bench"],
                    help="training scripts to measure (see scripts/bench/elastic_worker.py)")
    ap.add_argument("--nodes", type=int, default=2, help="nodes in the full job (the last one joins / dies)")
    ap.add_argument("--nproc", type=int, default=2, help="workers per node")
    ap.add_argument("--json", type=Path, default=None, help="also write all results as JSON here")
    args = ap.parse_args(argv)
    if args.nodes < 2 or args.nproc < 1 or args.nodes * args.nproc > 8:
        ap.error("--nodes must be >= 2 and --nproc >= 1, with at most 8 workers in all")
    return args


def measure_all(args: argparse.Namespace, log_root: Path) -> List[Summary]:
    """Every scenario, client and variant, ``--runs`` times, interleaved (A B A B ...); progress on stdout."""
    summaries: List[Summary] = []
    for scenario in (["kill", "join", "leave"] if args.scenario == "all" else [args.scenario]):
        for client in args.client:
            group = [Summary(scenario, v, client) for v in VARIANTS[scenario]
                     if args.launcher in ("all", v.launcher) and (v.quick or not args.quick)]
            summaries += group
            for i in range(args.runs):
                for summary in group:
                    run = Run(summary.variant, scenario, log_root, i, client, args.nodes, args.nproc)
                    try:
                        outcome = measure(run, args.timeout, args.warm_steps)
                    finally:
                        run.close()
                    summary.outcomes.append(outcome)
                    print(f"{scenario:5s} {client:7s} {summary.variant.label:38s} run {i + 1}/{args.runs}: "
                          f"{outcome.status:6s} {fmt(outcome.seconds):>6s} s  load {os.getloadavg()[0]:.2f} "
                          f"{outcome.detail} {outcome.phases or ''}", flush=True)
    return summaries


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    common.interrupt_on(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGINT too: may be ignored when backgrounded
    log_root = Path(tempfile.mkdtemp(prefix="bench_elastic-"))
    print(f"# logs in {log_root}; load average {os.getloadavg()[0]:.2f} at start", flush=True)
    try:
        summaries = measure_all(args, log_root)
    except KeyboardInterrupt:  # the run's processes were killed on the way out (Run.close)
        print(f"# interrupted; processes cleaned up; logs kept in {log_root}", file=sys.stderr)
        return 130
    print(f"\n{table(summaries)}\n\n# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    write_json(args.json, {"results": [s.as_dict() for s in summaries], "load_average_end": os.getloadavg()[0],
                           "summary": summary_rows(summaries, shown_command(__file__, argv))})
    if all(o.status == "ok" for s in summaries for o in s.outcomes):
        shutil.rmtree(log_root, ignore_errors=True)
    else:
        print(f"# logs kept in {log_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
