"""Seeded chaos soak: a 3-4 node elasticrun job of examples/train.py on this machine, under faults.

    sudo python -m scripts.chaos --minutes 30 --seed 7            # the table (from the repository root)
    python -m scripts.chaos --minutes 1 --seed 1614 --json        # + the summary as JSON (CI)
    python -m scripts.chaos --minutes 1 --faults worker_kill,etcd_outage
    python -m scripts.chaos --minutes 1 --seed 7 --etcd-members 3  # a 3-member etcd: member and leader loss

Nodes are agent processes with one worker each (``scripts/chaos/worker.py``: the example plus a
per-step sample audit log). One etcd member; the checkpoint root is a small tmpfs (for ``disk_full``);
one node runs in its own network namespace, joined by a veth pair (for ``partition``). Faults come
from ``random.Random(seed)`` (see scripts/chaos/faults.py); after each one the soak waits for the
recovery, with a deadline. Agents run with ``--hang-timeout`` (the ``hang`` fault) and a ``--metrics-port``
(``slow_metrics``); workers take memory snapshots when ``shm_full`` is drawn. ``bad_record``, ``slow_metrics``
and ``job_reuse`` come from outside the job (scripts/chaos/hostile.py). The job's goodput is read with
``elasticrun status --json``. At the end the job is told its last step, must exit 0, and the audit logs
must show every sample of the lineage exactly once. Exit 0 only when no invariant broke; 1 on a
violation or hang; 2 on bad arguments or when the machine cannot host the soak.

Needs root for the tmpfs and the namespace; without it those two faults are skipped (said so).
Everything started -- processes, the mount, the namespace -- is removed on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from .audit import analyse
from .env import REPO, Launcher, NetNs, Tmpfs, freeze_code, kill_tree
from .faults import DRAWN, MULTI_MEMBER, SINGLE_MEMBER, Kind, schedule
from .goodput import job_goodput
from .members import Members
from .report import render, summary
from .soak import Soak, Tail

DATASET, SEED_DATA = 2048, 0


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, required=True, help="fault-injection time (the job's start and end "
                   "come on top)")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--faults", default="all", help="comma-separated kinds, or 'all': " +
                   ", ".join(k.value for k in DRAWN))
    p.add_argument("--nodes", type=int, default=3, choices=[3, 4], help="nodes at the start (max 4)")
    p.add_argument("--etcd-members", type=int, default=1, choices=[1, 3], help="1: one etcd member (faults "
                   "etcd_restart, etcd_outage); 3: a local 3-member cluster, agents given all three endpoints "
                   "(faults member_loss, leader_loss)")
    p.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    p.add_argument("--json-file", help="write the summary as JSON here")
    p.add_argument("--recovery-deadline", type=float, default=120.0, help="seconds a recovery may take")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0)
    p.add_argument("--hang-timeout", type=float, default=10.0, help="the agents' --hang-timeout (the hang fault "
                   "needs it; 0 turns hang detection off and skips that fault)")
    p.add_argument("--workdir", help="keep logs here (default: a temporary folder, removed unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the logs and audit files")
    p.add_argument("--keep-going", action="store_true", help="after a hang, record it, kill every agent, start "
                   "the nodes afresh and go on (the exit code still says it failed)")
    p.add_argument("--live-code", action="store_true", help="agents import the working tree as it is when they "
                   "start (default: a copy taken at the soak's start, so edits meanwhile do not leak in)")
    args = p.parse_args(argv)
    if not (0 < args.minutes <= 24 * 60):
        p.error(f"--minutes must be in (0, 1440], got {args.minutes}")
    if not (args.hang_timeout == 0 or 2 <= args.hang_timeout <= 600):
        p.error(f"--hang-timeout must be 0 (off) or between 2 and 600 seconds, got {args.hang_timeout:g}")
    if not (10 <= args.recovery_deadline <= 3600):
        p.error("--recovery-deadline must be between 10 and 3600 seconds")
    names = {k.value: k for k in DRAWN}
    other = SINGLE_MEMBER if args.etcd_members == 3 else MULTI_MEMBER  # faults of the other etcd mode
    if args.faults == "all":
        args.kinds = [k for k in DRAWN if k not in other]
    else:
        wanted = [f.strip() for f in args.faults.split(",") if f.strip()]
        bad = [w for w in wanted if w not in names]
        if bad or not wanted:
            p.error(f"unknown fault kind(s) {', '.join(bad) or '(none)'}; choose from {', '.join(names)}")
        args.kinds = [names[w] for w in wanted]
        wrong = [k.value for k in args.kinds if k in other]
        if wrong:
            p.error(f"fault kind(s) {', '.join(wrong)} need --etcd-members {1 if args.etcd_members == 3 else 3}")
    return args


class Cleanup:
    """Undo everything in reverse order, once (finally, atexit and signals all land here)."""

    def __init__(self) -> None:
        self.actions: List[Any] = []
        self.done = False

    def add(self, fn: Any) -> None:
        self.actions.append(fn)

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        for fn in reversed(self.actions):
            try:
                fn()
            except Exception as err:  # noqa: BLE001 - cleanup must go on
                print(f"cleanup: {err}", file=sys.stderr)


def sweep(marker: str) -> None:
    """Kill any process left whose command line mentions this run's folder."""
    import psutil

    mine = {os.getpid(), *(a.pid for a in psutil.Process().parents())}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid not in mine and any(marker in part for part in (p.info["cmdline"] or [])):
                kill_tree(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    cleanup = Cleanup()
    atexit.register(cleanup)

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        return run(args, say, cleanup)
    except KeyboardInterrupt:
        say("interrupted: cleaning up")
        return 130
    finally:
        cleanup()


def run(args: argparse.Namespace, say: Any, cleanup: Cleanup) -> int:
    from elasticrun.errors import ElasticrunError
    from elasticrun.store.server import EtcdServer

    run_dir = Path(args.workdir or tempfile.mkdtemp(prefix="elasticrun-chaos-")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if not args.workdir and not args.keep:
        cleanup.add(lambda: shutil.rmtree(run_dir, ignore_errors=True))
    audit_dir, ckpt_root = run_dir / "audit", run_dir / "ckpts"
    audit_dir.mkdir(exist_ok=True)
    cleanup.add(lambda: sweep(str(run_dir)))
    skipped: Dict[str, str] = {}
    kinds = list(args.kinds)
    root = os.geteuid() == 0

    netns: Optional[NetNs] = None
    if Kind.PARTITION in kinds and args.etcd_members == 3:
        skipped[Kind.PARTITION.value] = "the 3-member etcd listens on loopback only"
        kinds.remove(Kind.PARTITION)
    if Kind.PARTITION in kinds:
        netns = NetNs(str(os.getpid() % 100000))
        why = netns.setup() if root else "needs root (network namespaces)"
        if why:
            skipped[Kind.PARTITION.value], netns = why, None
            kinds.remove(Kind.PARTITION)
        else:
            cleanup.add(netns.close)
    tmpfs: Optional[Tmpfs] = None
    if Kind.DISK_FULL in kinds:
        tmpfs = Tmpfs(ckpt_root, 64)
        why = tmpfs.setup() if root else "needs root (mount -t tmpfs)"
        if why:
            skipped[Kind.DISK_FULL.value], tmpfs = why, None
            kinds.remove(Kind.DISK_FULL)
        else:
            cleanup.add(tmpfs.close)
    if Kind.HANG in kinds and not args.hang_timeout:
        skipped[Kind.HANG.value] = "--hang-timeout 0 (hang detection off)"
        kinds.remove(Kind.HANG)
    for kind, why in skipped.items():
        say(f"skipping fault {kind}: {why}")
    if not kinds:
        say("error: no fault kind left to inject; run as root or choose other --faults")
        return 2
    ckpt_root.mkdir(exist_ok=True)

    host = netns.host_addr if netns else "127.0.0.1"
    etcd: Optional[EtcdServer] = None
    members: Optional[Members] = None
    if args.etcd_members == 3:
        members = Members(run_dir / "etcd")
        cleanup.add(members.stop)
    else:
        etcd = EtcdServer(host=host, data_dir=str(run_dir / "etcd"), log_path=str(run_dir / "etcd.log"))
    try:
        if members is not None:
            members.start(timeout=60)
        else:
            assert etcd is not None
            etcd.start(timeout=60)
    except ElasticrunError as err:
        say(f"error: cannot start etcd: {err}")
        return 2

    def stop_etcd() -> None:
        if etcd is not None and etcd.proc is not None and etcd.proc.poll() is None:
            os.kill(etcd.proc.pid, signal.SIGCONT)
        if etcd is not None:
            etcd.stop(remove_data=False)

    cleanup.add(stop_etcd)
    endpoint = members.endpoints if members is not None else etcd.endpoint  # type: ignore[union-attr]
    stop_file = run_dir / "stop-at-step"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "TORCHELASTIC_"))}
    (run_dir / "tmp").mkdir(exist_ok=True)  # temp folders of killed agents stay in the run folder
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CHAOS_AUDIT_DIR=str(audit_dir),
               CHAOS_STOP_FILE=str(stop_file), CHAOS_HANG_FILE=str(run_dir / "hang-pid"),
               CHAOS_SHM_FULL_FILE=str(run_dir / "shm-full-node"), TMPDIR=str(run_dir / "tmp"),
               CUDA_VISIBLE_DEVICES="")  # simulated nodes share this host: CPU and gloo (NCCL: one GPU each)
    worker_args = ["--epochs", "1000000", "--dataset-size", str(DATASET), "--seed", str(SEED_DATA),
                   "--ckpt-dir", str(ckpt_root), "--ckpt-every", "20", "--keep-last", "4", "--step-sleep", "0.1"]
    if Kind.SHM_FULL in kinds:
        worker_args += ["--snapshot-every", "5"]  # the memory tier in use (shm_full fills it)
    code_root = REPO if args.live_code else freeze_code(run_dir / "code")
    env["PYTHONPATH"] = os.pathsep.join([str(code_root), *filter(None, [os.environ.get("PYTHONPATH")])])
    launcher = Launcher(endpoint, f"chaos-{args.seed}", host, run_dir, worker_args, env, netns,
                        ns_slot=(args.nodes - 1) if netns else None, heartbeat=args.heartbeat_timeout,
                        hang_timeout=args.hang_timeout,
                        code_root=code_root)
    cleanup.add(launcher.close)
    soak = Soak(launcher, etcd, tmpfs, netns, ckpt_root, Tail(audit_dir), args.recovery_deadline, say,
                keep_going=args.keep_going, members=members, hang_file=run_dir / "hang-pid",
                shm_file=run_dir / "shm-full-node")
    say(f"chaos soak: seed {args.seed}, {args.minutes:g} min, {args.nodes} nodes, faults "
        f"{', '.join(k.value for k in kinds)}; logs in {run_dir}")
    soak.start(args.nodes)
    t_begin = time.time()
    if not soak.wait("the first step", lambda: soak.last_step_t > 0, 240):
        soak.violations.append("the job did not train a single step within 240 s of starting")
        soak.aborted = True
    end = time.monotonic() + args.minutes * 60
    faults = schedule(args.seed, kinds, args.minutes, args.heartbeat_timeout)
    while not soak.aborted and time.monotonic() < end:
        fault = next(faults)
        soak.faults.append(fault)
        soak.inject(fault)
        if fault.skipped:
            say(f"  {fault.kind.value}: skipped ({fault.skipped})")
            continue
        ttr = "-" if fault.ttr is None else f"{fault.ttr:.1f}s"
        say(f"+{fault.t_start - t_begin:6.1f}s {fault.kind.value:<13} {fault.target}: recovered in {ttr} "
            f"{'; '.join(fault.notes)}")
        soak.sleep(fault.gap)
        if time.time() - soak.last_step_t > args.recovery_deadline:
            soak.hang(f"no training step for {args.recovery_deadline:.0f}s between faults (hang)")
    if not soak.aborted:
        soak.finish(stop_file, margin=30, timeout=max(120.0, args.recovery_deadline))
    audit = analyse(Tail(audit_dir).poll(), DATASET, SEED_DATA)
    goodput = job_goodput(endpoint, launcher.job, env, code_root)
    result = summary(args, soak, audit, skipped, time.time() - t_begin, goodput)
    render(result, say)
    if args.json:
        print(json.dumps(result, sort_keys=True), flush=True)
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
