#!/usr/bin/env python
"""Elastic reaction time: elasticrun against torchrun (c10d), N nodes x P procs on loopback.

    python scripts/bench/bench_elastic.py --runs 1 --quick
    python scripts/bench/bench_elastic.py --runs 3 --scenario all --launcher all
    python scripts/bench/bench_elastic.py --scenario crash --quick --nodes 3 --nproc 1 --client inplace bench

Scenarios (docs/performance.md, "Node loss and scale-up"): ``kill`` (the last node's agent and everything under it
get SIGKILL), ``join`` (the last node starts), ``leave`` (the last node's agent gets SIGTERM), ``kill-host`` (the
kill of node A, which hosts the rendezvous) and ``crash`` (the last rank's worker alone gets SIGKILL), each timed
to the first step at the new world size, with ``phases`` (the survivors' pause, steps redone, ...). Variants run
interleaved, each with its own etcd or c10d port; ``--json`` adds the ``summary`` (each elasticrun variant
against the best torchrun one).
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

from common import (
    TORCHRUN_TUNED_CONF,
    TRAIN,
    Agents,
    AgentsExited,
    interrupt_on,
    md_table,
    shown_command,
    summary_row,
    write_json,
)

STABILITY_WINDOW = 1.0
HERE = Path(__file__).resolve().parent
STEP_RE = re.compile(r"STEP (\d+) WORLD (\d+) TIME (\d+(?:\.\d+)?)")  # elastic_worker.py's step lines
EXAMPLE_RE = re.compile(r"(?:^|\]:)step (\d+) loss \S+ world (\d+)")  # examples/train.py's
Step = Tuple[int, int, float]  # (step, world size, unix time)


@dataclass(frozen=True)
class Client:
    """One training script under test (``--client``): ``bench``, ``inplace``, ``plain``: the loops of
    ``elastic_worker.py``; ``example``: ``examples/train.py`` (DDP, elastic sampler, checkpoint on SIGTERM,
    control polling), whose step lines carry no time (they get the time the bench read them)."""

    name: str

    def argv(self, out_dir: Path) -> List[str]:
        """The script and its arguments (after the launcher's own options)."""
        if self.name == "example":
            return [str(TRAIN), "--epochs", "1000000", "--ckpt-dir",
                    str(out_dir / "ckpt"), "--ckpt-every", "0", "--step-sleep", "0.05"]
        return [str(HERE / "elastic_worker.py"), self.name, str(out_dir)]

    def parse(self, line: str, read_at: float) -> Optional[List[Step]]:
        """The steps that one output line reports (None: none)."""
        if self.name == "example":
            m = EXAMPLE_RE.search(line)
            return [(int(m[1]), int(m[2]), read_at)] if m else None
        return [(int(m[1]), int(m[2]), float(m[3])) for m in STEP_RE.finditer(line)] or None


CLIENTS = {name: Client(name) for name in ("bench", "plain", "example", "inplace")}


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

    def target(self, scenario: str) -> Optional[float]:
        """elasticrun's target in seconds (kill: heartbeat + 2 s; join: window + 2 s); None for torchrun."""
        if self.launcher != "elasticrun":
            return None
        return self.heartbeat + 2.0 if scenario.startswith("kill") or scenario == "crash" else STABILITY_WINDOW + 2.0


VARIANTS: Dict[str, List[Variant]] = {
    "kill": [
        Variant("elasticrun", "elasticrun hb=3 prewarm", 3.0, True),
        Variant("elasticrun", "elasticrun hb=3 no-prewarm", 3.0, False),
        Variant("elasticrun", "elasticrun hb=5 (default) prewarm", 5.0, True),
        Variant("elasticrun", "elasticrun hb=5 (default) no-prewarm", 5.0, False),
        Variant("torchrun", "torchrun c10d default"),
        Variant("torchrun", "torchrun c10d tuned", tuned=True),
    ],
    "join": [
        Variant("elasticrun", "elasticrun sw=1 prewarm", 3.0, True),
        Variant("elasticrun", "elasticrun sw=1 no-prewarm", 3.0, False),
        Variant("elasticrun", "elasticrun sw=1 prewarm no-inplace", 3.0, True, inplace=False),
        Variant("torchrun", "torchrun c10d default"),
        Variant("torchrun", "torchrun c10d tuned", tuned=True),
    ],
}
VARIANTS["leave"] = VARIANTS["join"]
VARIANTS["crash"] = [
    Variant("elasticrun", "elasticrun hb=3 prewarm", 3.0, True),
    Variant("elasticrun", "elasticrun hb=3 prewarm no-inplace", 3.0, True, inplace=False),
    Variant("torchrun", "torchrun c10d tuned", tuned=True),
]
VARIANTS["kill-host"] = [
    Variant("elasticrun", "elasticrun c10d hb=3 prewarm", 3.0, True, hosted=True),
    Variant("elasticrun", "elasticrun c10d hb=5 (default) prewarm", 5.0, True, hosted=True),
    Variant("torchrun", "torchrun c10d tuned", tuned=True),
]
QUICK_LABELS = {"elasticrun hb=3 prewarm", "elasticrun sw=1 prewarm", "elasticrun sw=1 prewarm no-inplace",
                "elasticrun c10d hb=3 prewarm", "torchrun c10d tuned"}
MEMBERS_TOLD = "(3 members;"  # an agent's line once it was told the job's etcd has 3 members


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
        """Seconds of the successful runs."""
        return [o.seconds for o in self.outcomes if o.status == "ok" and o.seconds is not None]

    def median(self) -> Optional[float]:
        return statistics.median(self.times) if self.times else None

    def phases(self) -> Dict[str, float]:
        """Median seconds to each phase (joined, round, pause) over the runs that logged it."""
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
                     f"{fmt(min(t) if t else None)}–{fmt(max(t) if t else None)}",
                     sum(o.status == "failed" for o in s.outcomes), sum(o.status == "hang" for o in s.outcomes), met,
                     phases])
    return md_table(["scenario", "client", "variant", "runs", "median s", "min–max s", "failed", "hung",
                     "target s (met)", "phases"], rows)


def summary_rows(summaries: List[Summary], command: str) -> List[Dict[str, Any]]:
    """The JSON ``summary``: each elasticrun variant's median against the best torchrun variant's."""
    rows: List[Dict[str, Any]] = []
    for s in summaries:
        med = s.median()
        alts = [(o.median(), o.variant.label) for o in summaries if o.scenario == s.scenario
                and o.client == s.client and o.variant.launcher == "torchrun" and o.median() is not None]
        if s.variant.launcher == "elasticrun" and med is not None and alts:
            alt_value, alt = min(alts)
            rows.append(summary_row(f"{s.scenario} -> first step ({s.client} client, {s.variant.label})", med, alt,
                                    alt_value, command=command))
    return rows


class Run:
    """One benchmark run: a fresh rendezvous (etcd or c10d port), job id, log dir and agents."""

    def __init__(self, variant: Variant, scenario: str, log_root: Path, index: int, client: Client,
                 nodes: int = 2, nproc: int = 2) -> None:
        self.variant = variant
        self.scenario = scenario
        self.client = client
        self.nnodes = nodes
        self.nproc = nproc
        slug = re.sub(r"[^a-z0-9]+", "-", variant.label.lower()).strip("-")
        self.dir = log_root / f"{scenario}-{client.name}-{slug}-{index}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.job = f"bench-{uuid.uuid4().hex[:8]}"
        self.agents = Agents(log_dir=self.dir, parse=client.parse)
        env = self.agents.env  # none of a job's variables that the bench itself might run under
        for name in [k for k in env if k.startswith(("ELASTICRUN_", "TORCHELASTIC_", "TORCH_DISABLE_SHARE_"))]:
            del env[name]
        # CUDA hidden: the simulated nodes share this host (on a GPU host, NCCL would put each on cuda:0).
        env["CUDA_VISIBLE_DEVICES"] = ""
        if variant.tuned:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.etcd = None
        self.port = 0
        if variant.launcher == "elasticrun" and not variant.hosted:
            from elasticrun.store.server import EtcdServer

            self.etcd = EtcdServer(log_path=str(self.dir / "etcd.log")).start()
        else:
            from elasticrun.store.server import free_port

            self.port = free_port()

    def command(self, name: str) -> List[str]:
        """The agent command line for node ``name`` (A hosts the torchrun c10d store)."""
        v = self.variant
        train = self.client.argv(self.dir)
        nnodes, nproc = f"1:{self.nnodes}", str(self.nproc)
        if v.launcher == "elasticrun":
            hosted = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-conf",
                      f"is_host={int(name == 'A')}"]
            rdzv = hosted if self.etcd is None else ["--rdzv-endpoint", self.etcd.endpoint]
            return [
                sys.executable, "-m", "elasticrun", "--nnodes", nnodes, "--nproc-per-node", nproc,
                *rdzv, "--rdzv-id", self.job, "--node-id", name,
                "--local-addr", "127.0.0.1", "--heartbeat-timeout", str(v.heartbeat),
                "--stability-window", str(STABILITY_WINDOW), "--max-restarts", "100",
                "--prewarm" if v.prewarm else "--no-prewarm", "--inplace" if v.inplace else "--no-inplace", *train,
            ]
        conf = f"is_host={'true' if name == 'A' else 'false'}"
        if v.tuned:
            conf = f"{TORCHRUN_TUNED_CONF},{conf}"
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", nproc,
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.job,
            "--rdzv-conf", conf, "--max-restarts", "100", "--local-addr", "127.0.0.1", *train,
        ]

    def start(self, name: str) -> float:
        """Start node ``name``'s agent; the time it was started."""
        self.agents.start(name, self.command(name))
        return self.agents.started[name]

    def mark(self, name: str, text: str) -> Optional[float]:
        """When node ``name``'s agent first printed a line containing ``text`` (None if not yet)."""
        return next((ln.t for ln in self.agents.lines(name) if text in ln.text), None)

    def steps(self) -> List[Step]:
        """Every ``(step, world, time)`` that rank 0 printed, through any agent."""
        return [step for found in self.agents.found() for step in found]

    def pause(self, old: int, new: int, since: float) -> float:
        """The survivors' pause: the last step at world ``old`` → the first at ``new`` (after ``since``)."""
        rows = sorted((t, w) for (_, w, t) in self.steps())
        first_new = min(t for t, w in rows if w == new and t >= since)
        return round(first_new - max((t for t, w in rows if w == old and t <= first_new), default=first_new), 3)

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
            rows = sorted(t for (_, w, t) in self.steps() if w == world and t >= after)
            return rows[count - 1] if len(rows) >= count else None

        return self.wait(reached, after, timeout, f"a step at world size {world}")

    def close(self) -> None:
        """Kill every process of this run and stop etcd."""
        self.agents.close()
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None


def measure(run: Run, args: argparse.Namespace) -> Outcome:
    """Set the scenario up (a steady job), cause the change, and time the first step after it."""
    names = [chr(ord("A") + i) for i in range(run.nnodes)]
    full, less = run.nnodes * run.nproc, (run.nnodes - 1) * run.nproc
    joins = run.scenario == "join"
    for name in names[:-1] if joins else names:
        run.start(name)
    ready = run.wait_step(less if joins else full, 0.0, args.timeout, count=args.warm_steps)
    if ready.status != "ok":
        return Outcome(ready.status, None, "setup: " + ready.detail)
    if joins:
        return join(run, names[-1], less, full, args.timeout)
    if run.scenario == "kill-host":
        return kill_host(run, names, less, args.timeout)
    if run.scenario == "leave":
        at = run.agents.terminate(names[-1])
        outcome = run.wait_step(less, at, args.timeout)
        if outcome.status == "ok":
            outcome.phases["pause"] = run.pause(full, less, at)
        return outcome
    before = max(run.steps(), key=lambda s: s[2])
    if run.scenario == "kill":
        at = run.agents.kill(names[-1])
        return with_pause(run, run.wait_step(less, at, args.timeout), before, at)
    pid_file = run.dir / f"pid-{full - 1}"  # crash: the last rank's worker (its pid, from elastic_worker.py)
    if not pid_file.exists():
        return Outcome("failed", None, f"setup: {run.client.name} wrote no {pid_file.name}: use --client bench or "
                       "inplace")
    at = time.time()
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    return with_pause(run, run.wait_step(full, at, args.timeout), before, at)


def join(run: Run, name: str, less: int, full: int, timeout: float) -> Outcome:
    """Start node ``name``; its first step in the job, and where the time went (elasticrun's agent lines)."""
    started = run.start(name)
    outcome = run.wait_step(full, started, timeout)
    for phase, text in (("joined", "joined job"), ("round", "(ScaleUp): world size")):
        at = run.mark(name, text)
        if at is not None:
            outcome.phases[phase] = round(at - started, 3)
    if outcome.status == "ok":
        outcome.phases["pause"] = run.pause(less, full, started)
    return outcome


def with_pause(run: Run, outcome: Outcome, before: Step, at: float) -> Outcome:
    """Add the survivors' pause (their last step before the fault at ``at`` → their first step after it, at
    any world size) and the steps redone (the step counter went back) to a successful ``outcome``."""
    if outcome.status == "ok":
        after = min((s for s in run.steps() if s[2] > at), key=lambda s: s[2])
        outcome.phases["pause"] = round(after[2] - before[2], 3)
        outcome.phases["redone"] = max(0, before[0] - after[0] + 1)
    return outcome


def kill_host(run: Run, names: List[str], less: int, timeout: float) -> Outcome:
    """Kill node A, which hosts the rendezvous; elasticrun's hosted etcd once every agent was told 3 members."""
    members = None
    if run.variant.hosted:

        def told() -> Optional[float]:
            marks = [run.mark(n, MEMBERS_TOLD) for n in names]
            return max(t for t in marks if t is not None) if all(marks) else None

        members = run.wait(told, run.agents.started[names[0]], timeout, "the job's etcd to have 3 members")
        if members.status != "ok":
            return Outcome(members.status, None, "setup: " + members.detail)
    outcome = run.wait_step(less, run.agents.kill(names[0]), timeout)
    if members is not None and members.seconds is not None:
        outcome.phases["members"] = round(members.seconds, 3)
    return outcome


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per variant and scenario")
    ap.add_argument("--scenario", choices=["kill", "join", "leave", "kill-host", "crash", "all"], default="all",
                    help="all: kill, join, leave")
    ap.add_argument("--launcher", choices=["elasticrun", "torchrun", "all"], default="all")
    ap.add_argument("--quick", action="store_true", help="only elasticrun hb=3/sw=1 prewarm and tuned torchrun")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per phase before a run counts as hung")
    ap.add_argument("--warm-steps", type=int, default=5, help="steps of a steady job before the change")
    ap.add_argument("--client", nargs="+", choices=sorted(CLIENTS), default=["bench"],
                    help="training scripts to measure (see scripts/bench/elastic_worker.py)")
    ap.add_argument("--nodes", type=int, default=2, help="nodes in the full job (the last one joins / dies)")
    ap.add_argument("--nproc", type=int, default=2, help="workers per node")
    ap.add_argument("--json", type=Path, default=None, help="also write all results as JSON here")
    args = ap.parse_args(argv)
    if args.nodes < 2 or args.nproc < 1 or args.nodes * args.nproc > 8:
        ap.error("--nodes must be >= 2 and --nproc >= 1, with at most 8 workers in all")
    return args


def chosen(args: argparse.Namespace, scenario: str, client: str) -> List[Summary]:
    """The variants ``--launcher`` and ``--quick`` select for one scenario and client."""
    return [Summary(scenario, v, client) for v in VARIANTS[scenario]
            if args.launcher in ("all", v.launcher) and (not args.quick or v.label in QUICK_LABELS)]


def measure_all(args: argparse.Namespace, log_root: Path) -> List[Summary]:
    """Every scenario, client and variant, ``--runs`` times, interleaved (A B A B ...); progress on stdout."""
    summaries: List[Summary] = []
    for scenario in (["kill", "join", "leave"] if args.scenario == "all" else [args.scenario]):
        for client in args.client:
            group = chosen(args, scenario, client)
            summaries += group
            for i in range(args.runs):
                for summary in group:
                    run = Run(summary.variant, scenario, log_root, i, CLIENTS[client], args.nodes, args.nproc)
                    try:
                        outcome = measure(run, args)
                    finally:
                        run.close()
                    summary.outcomes.append(outcome)
                    print(f"{scenario:5s} {client:7s} {summary.variant.label:38s} run {i + 1}/{args.runs}: "
                          f"{outcome.status:6s} {fmt(outcome.seconds):>6s} s  load {os.getloadavg()[0]:.2f} "
                          f"{outcome.detail} {outcome.phases or ''}", flush=True)
    return summaries


def main(argv: Optional[List[str]] = None) -> int:
    """Run the selected scenarios and variants; print progress and the results table."""
    args = parse_args(argv)
    interrupt_on(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGINT too: may be ignored when backgrounded
    log_root = Path(tempfile.mkdtemp(prefix="bench_elastic-"))
    print(f"# logs in {log_root}; load average {os.getloadavg()[0]:.2f} at start", flush=True)
    try:
        summaries = measure_all(args, log_root)
    except KeyboardInterrupt:  # the run's processes were killed on the way out (Run.close)
        print(f"# interrupted; processes cleaned up; logs kept in {log_root}", file=sys.stderr)
        return 130
    print(f"\n{table(summaries)}\n\n# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        doc = {"results": [s.as_dict() for s in summaries], "load_average_end": os.getloadavg()[0],
               "summary": summary_rows(summaries, shown_command(__file__, argv))}
        write_json(args.json, doc)
    if all(o.status == "ok" for s in summaries for o in s.outcomes):
        shutil.rmtree(log_root, ignore_errors=True)
    else:
        print(f"# logs kept in {log_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
