"""Seeded chaos soak: a 3-node elasticrun job of examples/train.py on this machine, under faults.

docs/reliability.md ("Chaos soak") says what the job is, what each fault does and which invariants are checked.
Exit 0 only when no invariant broke; 1 on a violation or hang; 2 on bad arguments or when the machine cannot
host the soak. Everything started -- processes, the mount, the namespace -- is removed on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import psutil

from elasticrun.errors import ElasticrunError
from scripts.bench.common import interrupt_on, kill_tree

from .audit import Tail, analyse
from .env import HOSTED, Machine
from .kinds import DRAWN, FaultKind, schedule
from .report import render, summary
from .soak import Soak

DATASET, SEED_DATA = 2048, 0
NODES, HEARTBEAT, DEADLINE = 3, 5.0, 120.0  # nodes at the start, agents' heartbeat timeout, recovery deadline (s)
Say = Callable[[str], None]


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, required=True, help="fault-injection time (start and end on top)")
    p.add_argument("--seed", type=int, required=True, help="draws the order (shuffled), targets and durations")
    p.add_argument("--faults", default="all", help="comma-separated kinds, injected in that order round after "
                   "round; 'all': every kind of the etcd mode, shuffled: " + ", ".join(k.name for k in DRAWN))
    p.add_argument("--shuffle", action="store_true", help="shuffle the --faults kinds in each round")
    p.add_argument("--etcd-members", type=int, default=1, choices=[1, 3], help="3: a local 3-member etcd (faults "
                   "member_loss, leader_loss instead of etcd_restart, etcd_outage)")
    p.add_argument("--hosted-etcd", action="store_true", help="the job hosts its etcd (c10d line, 3 members on 3 "
                   "nodes); agent_kill kills a node that runs a member, the first host while it lives")
    p.add_argument("--hang-timeout", type=float, default=10.0, help="the agents' --hang-timeout (0: off, no hang)")
    p.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    p.add_argument("--json-file", help="write the summary as JSON here")
    p.add_argument("--workdir", help="keep the logs and audit files here (default: a temporary folder)")
    args = p.parse_args(argv)
    why = bad_values(args)
    args.etcd_members = HOSTED if args.hosted_etcd else args.etcd_members
    args.shuffle = args.shuffle or args.faults == "all"
    args.kinds, wrong = fault_kinds(args)
    if why or wrong:
        p.error(why or wrong)
    return args


def fault_kinds(args: argparse.Namespace) -> Tuple[List[FaultKind], str]:
    """The kinds ``--faults`` names, less those the soak's etcd rules out with ``all``; or why it is wrong."""
    names = {k.name: k for k in DRAWN}
    wanted = list(names) if args.faults == "all" else [f.strip() for f in args.faults.split(",") if f.strip()]
    bad = [w for w in wanted if w not in names]
    if bad or not wanted:
        return [], f"unknown fault kind(s) {', '.join(bad) or '(none)'}; choose from {', '.join(names)}"
    wrong = [w for w in wanted if names[w].etcd_members not in (0, args.etcd_members)]
    if wrong and args.faults != "all":
        need = ("an etcd of the soak's own: drop --hosted-etcd" if args.hosted_etcd
                else f"--etcd-members {4 - args.etcd_members}")
        return [], f"fault kind(s) {', '.join(wrong)} need {need}"
    return [names[w] for w in wanted if w not in wrong], ""


def bad_values(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with ``--minutes``, ``--hang-timeout`` or the etcd options (None: nothing)."""
    if not 0 < args.minutes <= 24 * 60:
        return f"--minutes must be in (0, 1440], got {args.minutes}"
    if not (args.hang_timeout == 0 or 2 <= args.hang_timeout <= 600):
        return f"--hang-timeout must be 0 (off) or between 2 and 600 seconds, got {args.hang_timeout:g}"
    if args.hosted_etcd and args.etcd_members != 1:
        return "--hosted-etcd and --etcd-members are exclusive: the job's own etcd sizes itself"
    return None


def sweep(marker: str) -> None:
    """Kill any process left whose command line mentions this run's folder, and everything below it."""
    mine = {os.getpid(), *(a.pid for a in psutil.Process().parents())}
    kill_tree([p.pid for p in psutil.process_iter(["cmdline"])  # a process we may not read has cmdline None
               if p.pid not in mine and any(marker in part for part in (p.info["cmdline"] or []))])


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    say: Say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    interrupt_on(signal.SIGTERM, signal.SIGHUP)
    with ExitStack() as cleanup:  # undone in reverse order, signals (as KeyboardInterrupt) included
        try:
            return run(args, say, cleanup)
        except KeyboardInterrupt:
            say("interrupted: cleaning up")
            return 130


def run(args: argparse.Namespace, say: Say, cleanup: ExitStack) -> int:
    """Set the machine and the job up, inject faults until the time is up, end the job and judge it."""
    run_dir = Path(args.workdir or tempfile.mkdtemp(prefix="elasticrun-chaos-")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if not args.workdir:
        cleanup.callback(lambda: shutil.rmtree(run_dir, ignore_errors=True))
    machine = Machine(run_dir, f"chaos-{args.seed}", args.etcd_members, HEARTBEAT, args.hang_timeout, worker_args=[
        "--epochs", "1000000", "--dataset-size", str(DATASET), "--seed", str(SEED_DATA), "--ckpt-dir",
        str(run_dir / "ckpts"), "--ckpt-every", "20", "--keep-last", "4", "--step-sleep", "0.1"],
        undo=cleanup.callback)
    skipped = {k.name: why for k in dict.fromkeys(args.kinds) for why in [k.prepare(machine)] if why}
    cleanup.callback(lambda: sweep(str(run_dir)))  # every process started (agents, workers, etcd), before undo
    for name, why in skipped.items():
        say(f"skipping fault {name}: {why}")
    kinds = [k for k in args.kinds if k.name not in skipped]
    if not kinds:
        say("error: no fault kind left to inject; run as root or choose other --faults")
        return 2
    try:
        machine.start_etcd()
    except ElasticrunError as err:
        say(f"error: cannot start etcd: {err}")
        return 2
    machine.ns_slot = NODES - 1 if machine.netns else None
    soak = Soak(machine, Tail(machine.audit_dir), DEADLINE, say)
    say(f"chaos soak: seed {args.seed}, {args.minutes:g} min, {NODES} nodes, faults "
        f"{', '.join(k.name for k in kinds)}{' (shuffled)' if args.shuffle else ''}; logs in {run_dir}")
    soak.run(NODES, schedule(args.seed, kinds, args.minutes, HEARTBEAT, args.shuffle), args.minutes * 60)
    audit = analyse(Tail(machine.audit_dir).poll(), DATASET, SEED_DATA)
    result = summary(args, soak, audit, skipped)
    render(result, say)
    if args.json:
        print(json.dumps(result, sort_keys=True), flush=True)
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
