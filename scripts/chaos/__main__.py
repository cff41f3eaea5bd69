"""Seeded chaos soak: a 3-4 node elasticrun job of examples/train.py on this machine, under faults.

    sudo python -m scripts.chaos --minutes 30 --seed 7                # every kind, shuffled rounds (as root)
    python -m scripts.chaos --minutes 1 --seed 1 --faults worker_kill,etcd_outage --json   # in that order
    python -m scripts.chaos --minutes 1 --seed 7 --etcd-members 3     # a 3-member etcd: member and leader loss
    python -m scripts.chaos --minutes 2 --seed 7 --hosted-etcd --faults agent_kill   # the job's own etcd

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
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import psutil

from elasticrun.errors import ElasticrunError
from elasticrun.store.server import EtcdCluster, EtcdServer, free_port
from scripts.bench.common import interrupt_on, kill_tree

from .audit import Tail, analyse
from .env import HOSTED, Launcher, Machine, send
from .faults import FaultKind, schedule
from .kinds import DRAWN
from .report import job_goodput, render, summary
from .soak import Soak

DATASET, SEED_DATA = 2048, 0
Say = Callable[[str], None]


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, required=True, help="fault-injection time (the job's start and end "
                   "come on top)")
    p.add_argument("--seed", type=int, required=True, help="draws the order (with 'all'), targets and durations")
    p.add_argument("--faults", default="all", help="comma-separated kinds, injected in that order, round after "
                   "round; 'all': every kind of the etcd mode, each round shuffled: "
                   + ", ".join(k.name for k in DRAWN))
    p.add_argument("--shuffle", action="store_true", help="shuffle the --faults kinds in each round by --seed, as "
                   "'all' does")
    p.add_argument("--nodes", type=int, default=3, choices=[3, 4], help="nodes at the start (max 4)")
    p.add_argument("--etcd-members", type=int, default=1, choices=[1, 3], help="1: one etcd member (faults "
                   "etcd_restart, etcd_outage); 3: a local 3-member cluster, agents given all three endpoints "
                   "(faults member_loss, leader_loss)")
    p.add_argument("--hosted-etcd", action="store_true", help="no etcd of the soak's own: the job hosts its etcd "
                   "(torchrun's c10d line), which grows to 3 members on 3 nodes; agent_kill then kills a node that "
                   "runs a member, the node that hosted it first while it lives; later agents join at a live member")
    p.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    p.add_argument("--json-file", help="write the summary as JSON here")
    p.add_argument("--recovery-deadline", type=float, default=120.0, help="seconds a recovery may take")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--hang-timeout", type=float, default=10.0, help="the agents' --hang-timeout (the hang fault "
                   "needs it; 0 turns hang detection off and skips that fault)")
    p.add_argument("--workdir", help="keep the logs and audit files here (default: a temporary folder, removed "
                   "at the end)")
    args = p.parse_args(argv)
    if not (0 < args.minutes <= 24 * 60):
        p.error(f"--minutes must be in (0, 1440], got {args.minutes}")
    if not (args.hang_timeout == 0 or 2 <= args.hang_timeout <= 600):
        p.error(f"--hang-timeout must be 0 (off) or between 2 and 600 seconds, got {args.hang_timeout:g}")
    if not (10 <= args.recovery_deadline <= 3600):
        p.error("--recovery-deadline must be between 10 and 3600 seconds")
    if args.hosted_etcd:
        if args.etcd_members != 1:
            p.error("--hosted-etcd and --etcd-members are exclusive: the job's own etcd sizes itself")
        args.etcd_members = HOSTED
    args.shuffle = args.shuffle or args.faults == "all"
    args.kinds = _kinds(p, args.faults, args.etcd_members)
    return args


def _kinds(p: argparse.ArgumentParser, faults: str, members: int) -> List[FaultKind]:
    """The kinds ``--faults`` names, in its order; 'all': every drawn kind of the etcd mode."""
    if faults == "all":
        return [k for k in DRAWN if k.etcd_members in (0, members)]
    names = {k.name: k for k in DRAWN}
    wanted = [f.strip() for f in faults.split(",") if f.strip()]
    bad = [w for w in wanted if w not in names]
    if bad or not wanted:
        p.error(f"unknown fault kind(s) {', '.join(bad) or '(none)'}; choose from {', '.join(names)}")
    wrong = [w for w in wanted if names[w].etcd_members not in (0, members)]
    if wrong and members == HOSTED:
        p.error(f"fault kind(s) {', '.join(wrong)} need an etcd of the soak's own: drop --hosted-etcd")
    if wrong:
        p.error(f"fault kind(s) {', '.join(wrong)} need --etcd-members {4 - members}")
    return [names[w] for w in wanted]


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


def prepare(machine: Machine, wanted: List[FaultKind], say: Say) -> Tuple[List[FaultKind], Dict[str, str]]:
    """Each wanted kind sets the machine up (once); the kinds that can run here, and why the others cannot."""
    skipped: Dict[str, str] = {}
    for kind in dict.fromkeys(wanted):
        why = kind.prepare(machine)
        if why:
            skipped[kind.name] = why
            say(f"skipping fault {kind.name}: {why}")
    return [k for k in wanted if k.name not in skipped], skipped


def start_etcd(machine: Machine, cleanup: ExitStack) -> str:
    """Start the one member (on the host side of the namespace, if any) or the 3-member cluster; its endpoint(s).
    A hosted etcd: the endpoint its first agent hosts it at."""
    etcd_dir = machine.run_dir / "etcd"
    if machine.etcd_members == HOSTED:
        return f"127.0.0.1:{free_port()}"
    if machine.etcd_members == 3:
        etcd_dir.mkdir()
        cluster = machine.members = EtcdCluster(3, base_dir=str(etcd_dir))
        for m in cluster.members.values():
            m.log_path = str(etcd_dir / f"{m.name}.log")
        cleanup.callback(cluster.stop)
        return cluster.start(timeout=60).endpoints
    etcd = machine.etcd = EtcdServer(host=machine.host_addr, data_dir=str(etcd_dir),
                                     log_path=str(machine.run_dir / "etcd.log"))

    def stop() -> None:
        if etcd.proc is not None and etcd.proc.poll() is None:
            send(etcd.proc.pid, signal.SIGCONT)  # interrupted during an outage
        etcd.stop(remove_data=False)

    cleanup.callback(stop)
    etcd.start(timeout=60)
    return etcd.endpoint


def run(args: argparse.Namespace, say: Say, cleanup: ExitStack) -> int:
    """Set the machine and the job up, inject faults until the time is up, end the job and judge it."""
    run_dir = Path(args.workdir or tempfile.mkdtemp(prefix="elasticrun-chaos-")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if not args.workdir:
        cleanup.callback(lambda: shutil.rmtree(run_dir, ignore_errors=True))
    cleanup.callback(lambda: sweep(str(run_dir)))
    machine = Machine(run_dir, os.geteuid() == 0, args.etcd_members, args.hang_timeout, worker_args=[
        "--epochs", "1000000", "--dataset-size", str(DATASET), "--seed", str(SEED_DATA), "--ckpt-dir",
        str(run_dir / "ckpts"), "--ckpt-every", "20", "--keep-last", "4", "--step-sleep", "0.1"],
        undo=cleanup.callback)
    kinds, skipped = prepare(machine, args.kinds, say)
    if not kinds:
        say("error: no fault kind left to inject; run as root or choose other --faults")
        return 2
    machine.audit_dir.mkdir(exist_ok=True)
    machine.ckpt_root.mkdir(exist_ok=True)
    try:
        endpoint = start_etcd(machine, cleanup)
    except ElasticrunError as err:
        say(f"error: cannot start etcd: {err}")
        return 2
    launcher = Launcher(endpoint, f"chaos-{args.seed}", machine, args.heartbeat_timeout,
                        ns_slot=(args.nodes - 1) if machine.netns else None)
    cleanup.callback(launcher.close)
    soak = Soak(launcher, machine, Tail(machine.audit_dir), args.recovery_deadline, say)
    say(f"chaos soak: seed {args.seed}, {args.minutes:g} min, {args.nodes} nodes, faults "
        f"{', '.join(k.name for k in kinds)}{' (shuffled)' if args.shuffle else ''}; logs in {run_dir}")
    soak.start(args.nodes)
    if not soak.wait(soak.settled, 240):  # the faults' rounds are those formed after the start's
        soak.violations.append(f"the job did not train at all {args.nodes} nodes within 240 s of starting")
        soak.aborted = True
    soak.wait(launcher.offer_inplace, 60)  # the first fault meets a job that can recover in place
    end = time.monotonic() + args.minutes * 60
    faults = schedule(args.seed, kinds, args.minutes, args.heartbeat_timeout, shuffle=args.shuffle)
    while not soak.aborted and time.monotonic() < end:
        fault = next(faults)
        soak.faults.append(fault)
        soak.inject(fault)
        if fault.skipped:
            say(f"  {fault.kind.name}: skipped ({fault.skipped})")
            continue
        ttr = "-" if fault.ttr is None else f"{fault.ttr:.1f}s"
        say(f"+{fault.t_start - soak.t0:6.1f}s {fault.kind.name:<13} {fault.target}: recovered in {ttr} "
            f"{'; '.join(fault.notes)}")
        soak.sleep(fault.gap)
        if time.time() - soak.last_step_t > args.recovery_deadline:
            soak.hang(f"no training step for {args.recovery_deadline:.0f}s between faults (hang)")
    if not soak.aborted:
        soak.finish(margin=30, timeout=max(120.0, args.recovery_deadline))
    audit = analyse(Tail(machine.audit_dir).poll(), DATASET, SEED_DATA)
    result = summary(args, soak, audit, skipped, time.time() - soak.t0, job_goodput(launcher))
    render(result, say)
    if args.json:
        print(json.dumps(result, sort_keys=True), flush=True)
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
