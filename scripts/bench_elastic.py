#!/usr/bin/env python
"""Elastic reaction time: elasticrun against torchrun (c10d), two nodes x 2 procs on loopback.

Scenarios (CPU, gloo, ``OMP_NUM_THREADS=1``, ``scripts/bench_train.py`` as the training script):

``kill``  Nodes A and B (separate agent processes, own node ids) train at world size 4 with
          ``--nnodes 1:2``. Node B dies: its agent and every process under it get SIGKILL at the
          same instant (a machine that is gone; ``--kill-mode agent`` kills the agent alone).
          Measured: from the kill to the first step that node A's workers log at world size 2.
``join``  Node A trains alone at world size 2 (``--nnodes 1:2``). Node B's agent starts.
          Measured: from B's start to the first step at world size 4 (B's first step in the job).

Variants: elasticrun with ``--heartbeat-timeout`` 3 and 5 (the default), with and without
``--prewarm``; torchrun ``--rdzv-backend c10d`` with node A hosting the store, both with its
defaults and tuned (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
``--rdzv-conf last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3``).
Every elasticrun run gets its own real etcd (``EtcdServer``), stopped afterwards.

A run that does not reach the measured step within ``--timeout`` seconds is a *hang*; one
whose surviving agents all exit first is a *failure*. Every process a run starts carries a
unique marker in its environment and is SIGKILLed at the end of the run (also on Ctrl-C).

    python scripts/bench_elastic.py --runs 1 --quick
    python scripts/bench_elastic.py --runs 3 --scenario all --launcher all
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import psutil

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "scripts" / "bench_train.py"
STEP_RE = re.compile(r"STEP (\d+) WORLD (\d+) TIME (\d+(?:\.\d+)?)")
TAG_VAR = "BENCH_ELASTIC_TAG"
NPROC = 2
STABILITY_WINDOW = 1.0
TUNED_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


@dataclass(frozen=True)
class Variant:
    """One launcher configuration under test."""

    launcher: str  # "elasticrun" or "torchrun"
    label: str
    heartbeat: float = 5.0  # elasticrun --heartbeat-timeout
    prewarm: bool = True  # elasticrun --prewarm / --no-prewarm
    tuned: bool = False  # torchrun: tuned timeouts + TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

    def target(self, scenario: str) -> Optional[float]:
        """Issue 3's target in seconds for elasticrun; None for torchrun."""
        if self.launcher != "elasticrun":
            return None
        return self.heartbeat + 2.0 if scenario == "kill" else STABILITY_WINDOW + 3.0


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
        Variant("torchrun", "torchrun c10d default"),
        Variant("torchrun", "torchrun c10d tuned", tuned=True),
    ],
}
QUICK_LABELS = {"elasticrun hb=3 prewarm", "elasticrun sw=1 prewarm", "torchrun c10d tuned"}


@dataclass
class Outcome:
    """Result of one measured run: ``ok`` with seconds, or ``hang`` / ``failed`` with a reason."""

    status: str
    seconds: Optional[float] = None
    detail: str = ""


class Node:
    """One agent process (elasticrun or torchrun); a thread time-stamps its console output.

    Every line is kept in memory and written to ``log_path`` as ``<seconds since run start> line``,
    so the logs show where the time went.
    """

    def __init__(self, name: str, proc: subprocess.Popen, log_path: Path, started: float, epoch: float) -> None:
        self.name = name
        self.proc = proc
        self.log_path = log_path
        self.started = started
        self.dead = False  # killed on purpose by the benchmark
        self._lines: List[Tuple[float, str]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, args=(epoch,), daemon=True)
        self._reader.start()

    def _read(self, epoch: float) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for raw in self.proc.stdout:
                now = time.time()
                line = raw.decode(errors="replace").rstrip("\n")
                with self._lock:
                    self._lines.append((now, line))
                log.write(f"{now - epoch:8.3f} {line}\n")
                log.flush()

    def steps(self) -> List[Tuple[int, int, float]]:
        """Every ``(step, world, time)`` that rank 0 printed through this agent so far."""
        with self._lock:
            lines = list(self._lines)
        return [(int(m[1]), int(m[2]), float(m[3])) for _, ln in lines for m in STEP_RE.finditer(ln)]

    def running(self) -> bool:
        """Whether the agent process is still alive."""
        return self.proc.poll() is None

    def join_reader(self) -> None:
        """Wait (briefly) for the output thread once the process and its children are gone."""
        self._reader.join(5)


def tagged_processes(tag: str) -> List[psutil.Process]:
    """Every live process whose environment carries ``TAG_VAR=tag`` (ours, and only ours)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get(TAG_VAR) == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return found


def kill_all(procs: List[psutil.Process]) -> None:
    """SIGKILL each process and reap what can be reaped."""
    for p in procs:
        try:
            p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    psutil.wait_procs(procs, timeout=5)


class Run:
    """One benchmark run: a fresh rendezvous (etcd or c10d port), job id, output dir and nodes."""

    def __init__(self, variant: Variant, scenario: str, log_root: Path, index: int) -> None:
        self.variant = variant
        self.scenario = scenario
        self.tag = uuid.uuid4().hex
        self.job = f"bench-{self.tag[:8]}"
        slug = re.sub(r"[^a-z0-9]+", "-", variant.label.lower()).strip("-")
        self.dir = log_root / f"{scenario}-{slug}-{index}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.nodes: Dict[str, Node] = {}
        self.epoch = time.time()
        self.events: List[str] = []
        self.etcd = None
        self.port = 0
        if variant.launcher == "elasticrun":
            from elasticrun.store.server import EtcdServer

            self.etcd = EtcdServer(log_path=str(self.dir / "etcd.log")).start()
        else:
            from elasticrun.store.server import free_port

            self.port = free_port()

    def env(self) -> Dict[str, str]:
        """Environment of every agent: one thread per worker, unbuffered output, our marker."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "TORCHELASTIC_"))}
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{TAG_VAR: self.tag})
        if self.variant.tuned:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        return env

    def command(self, name: str) -> List[str]:
        """The agent command line for node ``name`` (A hosts the torchrun c10d store)."""
        v = self.variant
        train = [str(TRAIN), str(self.dir)]
        if v.launcher == "elasticrun":
            assert self.etcd is not None
            return [
                sys.executable, "-m", "elasticrun", "--nnodes", "1:2", "--nproc-per-node", str(NPROC),
                "--rdzv-endpoint", self.etcd.endpoint, "--rdzv-id", self.job, "--node-id", name,
                "--local-addr", "127.0.0.1", "--heartbeat-timeout", str(v.heartbeat),
                "--stability-window", str(STABILITY_WINDOW), "--max-restarts", "100",
                "--prewarm" if v.prewarm else "--no-prewarm", *train,
            ]
        conf = f"is_host={'true' if name == 'A' else 'false'}"
        if v.tuned:
            conf = f"{TUNED_CONF},{conf}"
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", str(NPROC),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", self.job,
            "--rdzv-conf", conf, "--max-restarts", "100", "--local-addr", "127.0.0.1", *train,
        ]

    def start(self, name: str) -> Node:
        """Start node ``name``'s agent in its own session; returns once it is spawned."""
        log_path = self.dir / f"{name}.log"
        cmd = self.command(name)
        (self.dir / f"{name}.cmd").write_text(" ".join(cmd) + "\n")
        started = time.time()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env(),
            cwd=str(REPO), start_new_session=True,
        )
        node = Node(name, proc, log_path, started, self.epoch)
        self.events.append(f"{started - self.epoch:8.3f} bench: started node {name}")
        self.nodes[name] = node
        return node

    def kill(self, name: str, mode: str) -> float:
        """SIGKILL node ``name`` (agent + whole tree, or agent only); returns the kill time."""
        node = self.nodes[name]
        try:
            tree = psutil.Process(node.proc.pid).children(recursive=True) if mode == "tree" else []
        except psutil.NoSuchProcess:
            tree = []
        at = time.time()
        node.proc.kill()
        for p in tree:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        node.dead = True
        self.events.append(f"{at - self.epoch:8.3f} bench: SIGKILL node {name} ({mode})")
        node.proc.wait(10)
        return at

    def wait_step(self, world: int, after: float, timeout: float, count: int = 1) -> Outcome:
        """Wait until ``count`` steps at ``world`` with time >= ``after`` appear in any node's output."""
        deadline = time.time() + timeout
        while True:
            rows = sorted(
                t for n in self.nodes.values() for (_, w, t) in n.steps() if w == world and t >= after
            )
            if len(rows) >= count:
                self.events.append(f"{rows[count - 1] - self.epoch:8.3f} bench: step {count} at world {world}")
                return Outcome("ok", rows[count - 1] - after)
            live = [n for n in self.nodes.values() if not n.dead]
            if live and not any(n.running() for n in live):
                codes = ", ".join(f"{n.name} exit {n.proc.returncode}" for n in live)
                return Outcome("failed", None, f"all agents exited ({codes})")
            if time.time() > deadline:
                return Outcome("hang", None, f"no step at world size {world} within {timeout:.0f}s")
            time.sleep(0.05)

    def close(self) -> None:
        """Kill every process of this run (agents, workers, orphans by marker) and stop etcd."""
        procs: List[psutil.Process] = []
        for node in self.nodes.values():
            try:
                agent = psutil.Process(node.proc.pid)
                procs += [agent, *agent.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        kill_all(procs)
        for node in self.nodes.values():
            try:
                node.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        kill_all(tagged_processes(self.tag))
        for node in self.nodes.values():
            node.join_reader()
        (self.dir / "events.txt").write_text("\n".join(self.events) + "\n")
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None


def measure(run: Run, args: argparse.Namespace) -> Outcome:
    """Set the scenario up (a steady job), cause the change, and time the first step after it."""
    settle = args.warm_steps
    if run.scenario == "kill":
        run.start("A")
        run.start("B")
        ready = run.wait_step(4, 0.0, args.timeout, count=settle)
        if ready.status != "ok":
            return Outcome(ready.status, None, "setup: " + ready.detail)
        at = run.kill("B", args.kill_mode)
        return run.wait_step(2, at, args.timeout)
    run.start("A")
    ready = run.wait_step(2, 0.0, args.timeout, count=settle)
    if ready.status != "ok":
        return Outcome(ready.status, None, "setup: " + ready.detail)
    joiner = run.start("B")
    return run.wait_step(4, joiner.started, args.timeout)


@dataclass
class Summary:
    """All runs of one variant in one scenario."""

    scenario: str
    variant: Variant
    outcomes: List[Outcome] = field(default_factory=list)

    @property
    def times(self) -> List[float]:
        """Seconds of the successful runs."""
        return [o.seconds for o in self.outcomes if o.status == "ok" and o.seconds is not None]

    def median(self) -> Optional[float]:
        """Median seconds over successful runs, or None."""
        return statistics.median(self.times) if self.times else None

    def as_dict(self) -> Dict[str, object]:
        """JSON-friendly form."""
        return {
            "scenario": self.scenario, "variant": self.variant.label,
            "target_s": self.variant.target(self.scenario), "median_s": self.median(),
            "outcomes": [o.__dict__ for o in self.outcomes],
        }


def fmt(x: Optional[float]) -> str:
    """Seconds with one decimal, or an en dash."""
    return "–" if x is None else f"{x:.1f}"


def table(summaries: List[Summary]) -> str:
    """A markdown table: runs, median/min/max, failures and hangs, target, ratios to torchrun."""
    lines = [
        "| scenario | variant | runs | median s | min s | max s | failed | hung | target s (met) "
        "| ÷ torchrun default | ÷ torchrun tuned |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        ref = {
            o.variant.tuned: o.median() for o in summaries
            if o.scenario == s.scenario and o.variant.launcher == "torchrun"
        }
        med, t = s.median(), s.times
        ratios = [
            f"{med / ref[k]:.2f}×" if med is not None and ref.get(k) else "–" for k in (False, True)
        ]
        target = s.variant.target(s.scenario)
        met = f"{target:.0f} ({sum(x <= target for x in t)}/{len(s.outcomes)})" if target is not None else "–"
        failed = sum(o.status == "failed" for o in s.outcomes)
        hung = sum(o.status == "hang" for o in s.outcomes)
        lines.append(
            f"| {s.scenario} | {s.variant.label} | {len(s.outcomes)} | {fmt(med)} | {fmt(min(t) if t else None)} "
            f"| {fmt(max(t) if t else None)} | {failed} | {hung} | {met} | {ratios[0]} | {ratios[1]} |"
        )
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per variant and scenario")
    ap.add_argument("--scenario", choices=["kill", "join", "all"], default="all")
    ap.add_argument("--launcher", choices=["elasticrun", "torchrun", "all"], default="all")
    ap.add_argument("--quick", action="store_true", help="only elasticrun hb=3/sw=1 prewarm and tuned torchrun")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per phase before a run counts as hung")
    ap.add_argument("--warm-steps", type=int, default=5, help="steps of a steady job before the change")
    ap.add_argument("--kill-mode", choices=["tree", "agent"], default="tree",
                    help="tree: SIGKILL node B's agent and all its processes at once; agent: the agent only")
    ap.add_argument("--log-dir", type=Path, default=None, help="keep agent logs here [default: a temp dir]")
    ap.add_argument("--json", type=Path, default=None, help="also write all results as JSON here")
    return ap.parse_args(argv)


def _interrupt(signum: int, frame: object) -> None:
    """Turn SIGINT/SIGTERM/SIGHUP into KeyboardInterrupt so the cleanup runs."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[List[str]] = None) -> int:
    """Run the selected scenarios and variants; print progress and the results table."""
    args = parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGINT too: may be ignored when backgrounded
        signal.signal(sig, _interrupt)
    scenarios = ["kill", "join"] if args.scenario == "all" else [args.scenario]
    own_logs = args.log_dir is None
    log_root = Path(tempfile.mkdtemp(prefix="bench_elastic-")) if own_logs else args.log_dir
    log_root.mkdir(parents=True, exist_ok=True)
    print(f"# logs in {log_root}; load average {os.getloadavg()[0]:.2f} at start", flush=True)
    summaries: List[Summary] = []
    current: Optional[Run] = None
    try:
        for scenario in scenarios:
            for variant in VARIANTS[scenario]:
                if args.launcher != "all" and variant.launcher != args.launcher:
                    continue
                if args.quick and variant.label not in QUICK_LABELS:
                    continue
                summary = Summary(scenario, variant)
                summaries.append(summary)
                for i in range(args.runs):
                    current = Run(variant, scenario, log_root, i)
                    try:
                        outcome = measure(current, args)
                    finally:
                        current.close()
                        current = None
                    summary.outcomes.append(outcome)
                    print(
                        f"{scenario:4s} {variant.label:38s} run {i + 1}/{args.runs}: {outcome.status:6s} "
                        f"{fmt(outcome.seconds):>6s} s  load {os.getloadavg()[0]:.2f} {outcome.detail}",
                        flush=True,
                    )
    except KeyboardInterrupt:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second Ctrl-C must not skip the cleanup
            signal.signal(sig, signal.SIG_IGN)
        if current is not None:
            current.close()
        print("# interrupted; processes cleaned up", file=sys.stderr)
        return 130
    print()
    print(table(summaries))
    print(f"\n# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps([s.as_dict() for s in summaries], indent=2))
    if own_logs and all(o.status == "ok" for s in summaries for o in s.outcomes):
        shutil.rmtree(log_root, ignore_errors=True)
    else:
        print(f"# logs kept in {log_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
