"""The node agent: join the job, run local workers for each round, re-form on any change.

    register → next_round → start workers → watch (workers, etcd) → stop → next_round …

One agent runs per node. It fences itself first whenever its lease is in doubt, so a
stale round never keeps training next to a new one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Union

from rich.text import Text

from elasticrun.errors import ElasticrunError, JobFailedError, StoreError
from elasticrun.job import env as env_names
from elasticrun.job.exitcodes import ExitCode, for_signal
from elasticrun.job.records import progress_record, read
from elasticrun.job.settings import drop_secrets_from_environment, to_file
from elasticrun.launch.c10d import RoundStore
from elasticrun.launch.config import LaunchConfig, RdzvBackend, signal_number
from elasticrun.launch.etcdmembers import EtcdMembers, start_members
from elasticrun.launch.failures import root_cause_table
from elasticrun.launch.hang import HangWatch
from elasticrun.launch.hosting import open_store, wait_others_left
from elasticrun.launch.inplace import InPlaceRounds
from elasticrun.launch.logfilter import unfed_warnings
from elasticrun.launch.node import accelerators, local_address, uses_gpu
from elasticrun.launch.nodecheck import admit, exclude
from elasticrun.launch.numa import AffinityMode, describe_binding, worker_cpus
from elasticrun.launch.observe import Observer
from elasticrun.launch.outage import STOP_SLACK_S, OutageGuard
from elasticrun.launch.roundloop import RoundLoop
from elasticrun.launch.shmroot import SnapshotRoot
from elasticrun.launch.stragglers import Drained, StragglerWatch
from elasticrun.launch.workers import WorkerGroup
from elasticrun.rendezvous.protocol import JobEnded, LeaseLost, Rendezvous, RendezvousSettings
from elasticrun.rendezvous.records import NodeInfo, Topology, WorkerStatus
from elasticrun.rendezvous.states import RoundOutcome
from elasticrun.store.client import EtcdStore, parse_endpoints
from elasticrun.store.server import EtcdServer


def log_time() -> str:
    """The time stamp of an agent line: UTC, ISO 8601, milliseconds (``2026-11-26T07:25:18.123Z``)."""
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def worker_signal(signum: int) -> int:
    """The signal workers get when ``signum`` stops the agent: SIGHUP and SIGQUIT become SIGTERM.

    SIGHUP (terminal closed) and SIGQUIT are handled like SIGTERM: their default action would kill a
    worker hard (SIGQUIT dumps core) without the chance to save that SIGTERM gives. Others go as received.
    """
    return int(signal.SIGTERM) if signum in (signal.SIGHUP, signal.SIGQUIT) else signum


class AgentSignal(Exception):
    """SIGINT/SIGTERM reached the agent."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Reporter:
    """Agent progress lines (``elasticrun[node]: ...``) on stderr via rich; plain when not a TTY."""

    label: str
    quiet: bool = False
    console: Any = field(default=None, init=False, repr=False)  # made in __post_init__

    def __post_init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False)

    def __call__(self, message: str) -> None:
        if not self.quiet:
            stamp = log_time()
            self.console.print(Text.assemble((stamp, "dim"), " ", (f"elasticrun[{self.label}]", "cyan"), ": ", message),
                               soft_wrap=True)

    def table(self, table: Any) -> None:
        # Not a terminal (a log file, a pipe): no width to fit, so no wrapping into narrow columns.
        if not self.console.is_terminal:
            self.console.width = 1000
        self.console.print(table)


class Agent:
    """Runs one node of a job until it succeeds, fails for good, or is told to stop."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.label = cfg.rendezvous.node_id if "@" not in cfg.rendezvous.node_id else socket.gethostname()
        self.say = Reporter(self.label, quiet=cfg.logs.quiet)
        self._signal: Optional[int] = None
        self._stopping = False  # set once the agent is stopping: no signal is raised again
        self._etcd_failed = False  # leaving on an etcd error: the teardown makes no call that waits on etcd
        self._wake: Callable[[], None] = lambda: None
        self._hang: Optional[HangWatch] = None  # --hang-timeout: made with the first round
        self._stragglers: Optional[StragglerWatch] = None  # the leader's scores, our node's drain
        self.obs = Observer(cfg)  # /metrics, goodput accounting, --events-file
        self.inplace: Optional[InPlaceRounds] = None  # in-place re-forming (made with the workers)
        self._round = -1  # the round our workers run in (a graceful leave marks it)
        self._members: Optional[EtcdMembers] = None  # a hosted etcd's members (launch/etcdmembers.py)

    # -- signals ----------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self._signal is None:
            self._signal = signum
            raise AgentSignal(signum)

    def _raise_pending_signal(self) -> None:
        """Raise a received signal again at the next loop turn: the exception raised by the handler
        can be lost when the signal lands inside library code that catches it (a gRPC call)."""
        if self._signal is not None and not self._stopping:
            raise AgentSignal(self._signal)

    def _install_signals(self) -> List[int]:
        """Handle the signals of :meth:`_handled_signals`; those handled (none off the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return []
        handled = self._handled_signals()
        for number in handled:
            signal.signal(number, self._on_signal)
        return handled

    def _handled_signals(self) -> List[int]:
        """--signals-to-handle (torchrun's default SIGTERM,SIGINT,SIGHUP,SIGQUIT); SIGTERM, SIGINT always."""
        numbers = {signal_number(name) for name in self.cfg.workers.signals_to_handle}
        return sorted(numbers | {int(signal.SIGTERM), int(signal.SIGINT)})

    # -- main ---------------------------------------------------------------------------------

    def run(self) -> int:
        """Run the job on this node; returns the process exit code."""
        cfg = self.cfg
        handled = self._install_signals()
        etcd: Optional[EtcdServer] = None
        store: Optional[EtcdStore] = None
        rdzv: Optional[Rendezvous] = None
        workers: Optional[WorkerGroup] = None
        snapshots: Optional[SnapshotRoot] = None
        files_dir = tempfile.mkdtemp(prefix=f"elasticrun-{cfg.rendezvous.rdzv_id}-")
        round_store = RoundStore(on_error=lambda line: self._store_failed(line, workers))
        with contextlib.ExitStack() as teardown:  # runs bottom to top; each line sees the resource made meanwhile
            teardown.callback(self._restore_signals, handled)
            teardown.callback(self.obs.close)  # /metrics answers until here
            teardown.callback(lambda: snapshots is not None and snapshots.remove())
            teardown.callback(shutil.rmtree, files_dir, ignore_errors=True)
            teardown.callback(lambda: etcd is not None and etcd.stop())
            teardown.callback(lambda: store is not None and store.close())
            teardown.callback(lambda: self._wait_others_left(etcd, store, rdzv))
            teardown.callback(lambda: rdzv is not None and rdzv.leave(revoke=not self._etcd_failed))
            teardown.callback(lambda: self.obs.detach(wait=0.0 if self._etcd_failed else 5.0))
            teardown.callback(lambda: self._hang is not None and self._hang.close())
            teardown.callback(lambda: self._stragglers is not None and self._stragglers.close())
            teardown.callback(round_store.close)
            teardown.callback(lambda: workers is not None and self._stop_workers(workers))
            teardown.callback(self._ignore_signals, handled)
            try:
                self.obs.start()  # a busy --metrics-port: one line, before anything started
                cfg.etcd_settings()  # resolve the password source now: a bad one fails before anything starts
                drop_secrets_from_environment(self.say)  # before any child process starts
                workers = self._worker_group(files_dir, round_store)
                self.inplace = InPlaceRounds(cfg, workers, self.say)
                snapshots = self._snapshot_root(workers)
                # The fork server (bare: the round loop has it preload once the CPU is free), or warm interpreters.
                workers.prewarm(preload=False)
                if cfg.rendezvous.nnodes_max == 1:  # we lead every round: the first store's host imports torch now
                    round_store.prepare(workers.host_store)
                etcd, store = open_store(cfg, self.say)  # standalone / c10d / static: may host the job's etcd
                self.obs.attach(store)
                if cfg.health.node_check:
                    self.obs.node_checking()
                admit(cfg, store, self.say, self.obs.node_checked)  # --node-check: NodeExcluded (exit 6) if it fails
                # Workers reach etcd (commit fence, progress, checkpoint requests) with the same settings.
                workers.etcd_settings_file = to_file(cfg.etcd_settings(), os.path.join(files_dir, "etcd-settings.json"))
                rdzv = Rendezvous(store, self._settings(hosting=etcd is not None), self._node_info(workers),
                                  round_store.fresh,
                                  on_progress=self.say)
                self._wake = rdzv.view.poke
                rdzv.on_beat = self._raise_pending_signal
                rdzv.ensure_config(cfg.job_settings())
                rdzv.register()  # a running job starts its stability window now
                self._stragglers = StragglerWatch(cfg, rdzv, self.say, self.obs.straggler_score).start()
                self._members = start_members(cfg, rdzv, etcd, workers.etcd_settings_file, self.say)
                r = cfg.rendezvous
                self.say(
                    f"joined job {r.rdzv_id!r} at {r.rdzv_endpoint} as {r.node_id} "
                    f"(nnodes {r.nnodes_min}:{r.nnodes_max}, {cfg.workers.nproc_per_node} "
                    f"worker{'s' * (cfg.workers.nproc_per_node != 1)})"
                )
                return self._loop(rdzv, workers)
            except StoreError:
                self._etcd_failed = True  # no final report, no revoke (the lease expires on its own)
                raise
            except AgentSignal as sig:
                return self._leave_on_signal(sig, rdzv, workers)
            except Drained as drained:
                self.obs.drained(drained.reason)
                if store is not None:  # status shows it under excluded
                    exclude(store, cfg.rendezvous.rdzv_id, cfg.rendezvous.node_id, drained.reason, "straggler")
                return self._leave_on_signal(drained, rdzv, workers)
        raise AssertionError("unreachable")  # pragma: no cover - the block returns or raises

    # -- start-up steps of run() ------------------------------------------------------------------

    def _worker_group(self, files_dir: str, round_store: RoundStore) -> WorkerGroup:
        """This node's workers: their log dir (-r/-t/filters without --log-dir: a temporary one that
        outlives us), the c10d store host of the rounds we lead, ``--numa-binding``'s CPUs."""
        cfg = self.cfg
        log_dir = cfg.logs.log_dir
        if log_dir is None and cfg.keeps_log_files():
            # Not under files_dir: that one is removed at exit, and these logs must outlive us.
            log_dir = tempfile.mkdtemp(prefix=f"elasticrun-logs-{cfg.rendezvous.rdzv_id}-")
            self.say(f"worker logs in {log_dir}")
        workers = WorkerGroup(cfg, self.label, files_dir, log_dir, uses_gpu(cfg.workers.device_kind),
                              on_exit=lambda: self._wake())
        workers.round_store = round_store  # served by a store host in the rounds we lead
        if cfg.workers.numa_binding:  # torchrun's choice of each local rank's CPUs, once, before the job starts
            workers.cpus = worker_cpus(AffinityMode(cfg.workers.numa_binding), cfg.workers.nproc_per_node)
            self.say(describe_binding(AffinityMode(cfg.workers.numa_binding), workers.cpus))
        for line in unfed_warnings(cfg):
            self.say(line)
        return workers

    def _snapshot_root(self, workers: WorkerGroup) -> Optional[SnapshotRoot]:
        """The memory tier's root of this agent (``--snapshots``), named in the workers' environment."""
        cfg = self.cfg
        if not cfg.memory.snapshots:
            return None
        snapshots = SnapshotRoot.create(cfg.rendezvous.rdzv_id, cfg.rendezvous.node_id, say=self.say)
        if snapshots is None:  # no usable /dev/shm: the workers say so when they snapshot
            return None
        workers.extra_env[env_names.SNAPSHOT_DIR] = snapshots.path
        if cfg.memory.snapshot_memory is not None:
            workers.extra_env[env_names.SNAPSHOT_MEMORY] = str(cfg.memory.snapshot_memory)
        return snapshots

    def _node_info(self, workers: WorkerGroup) -> NodeInfo:
        """What this node tells the job about itself (its node record)."""
        cfg = self.cfg
        host, port = parse_endpoints(cfg.rendezvous.rdzv_endpoint)[0]
        return NodeInfo(
            node_id=cfg.rendezvous.node_id,
            host=socket.gethostname(),
            addr=cfg.rendezvous.local_addr or local_address(host, port),
            nproc=cfg.workers.nproc_per_node,
            pid=os.getpid(),
            node_rank=-1 if cfg.rendezvous.node_rank is None else cfg.rendezvous.node_rank,
            accelerators=accelerators(workers.use_gpu),  # from the driver: no torch here
        )

    def _leave_on_signal(self, sig: Union[AgentSignal, Drained], rdzv: Optional[Rendezvous],
                         workers: Optional[WorkerGroup]) -> int:
        """SIGTERM/SIGINT (or another handled signal), or a straggler's drain: stop our workers, leave the job
        (in place where the others re-form in place); the exit code (a drained node's: 6)."""
        self._stopping = True
        drained = isinstance(sig, Drained)
        why = sig.reason if isinstance(sig, Drained) else f"received {sig}"
        code = ExitCode.NODE_UNHEALTHY if drained else for_signal(sig.signum)
        self.say(f"{why}: stopping workers and leaving the job" + (" (it stays out until restarted)"
                                                                  if drained else ""))
        wsig = worker_signal(sig.signum)
        if rdzv is not None and self.inplace is not None and self.inplace.leave_first(rdzv, self._round, wsig):
            wsig = 0  # signalled once already (a second SIGTERM kills); leave_first left the job
        if workers is not None:
            workers.stop(self.cfg.workers.shutdown_timeout, sig=wsig)
        if rdzv is not None:  # the job's end if we are its last node (rendezvous/ended.py)
            rdzv.leaving(why, code)
        if rdzv is not None and rdzv.lease is not None:
            try:
                if self._round >= 0:  # before the lease goes: the status says Left, not lost
                    rdzv.mark_left(self._round)
                rdzv.publish(status=WorkerStatus.LEAVING)
            except ElasticrunError:
                pass
        return code  # a signal: a retryable code (docs/deploy.md); a straggler's drain: 6

    # -- teardown steps of run() -----------------------------------------------------------------

    def _store_failed(self, line: str, workers: Optional[WorkerGroup]) -> None:
        """The round's c10d store host died (or could not serve): its workers can never meet. Say why
        and kill ours, so the round fails now instead of at torch's store timeout."""
        if self._stopping or workers is None:
            return
        self.say(f"{line}: stopping this round's workers")
        workers.kill_running()

    def _ignore_signals(self, handled: List[int]) -> None:
        """Leaving: from now on a second Ctrl-C must not interrupt the teardown."""
        self._stopping = True
        for number in handled:
            signal.signal(number, signal.SIG_IGN)

    def _restore_signals(self, handled: List[int]) -> None:
        for number in handled:
            signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)

    def _stop_workers(self, workers: WorkerGroup) -> None:
        workers.stop(self.cfg.workers.shutdown_timeout)
        workers.discard_warm()

    def _wait_others_left(
        self, etcd: Optional[EtcdServer], store: Optional[EtcdStore], rdzv: Optional[Rendezvous]
    ) -> None:
        """The agent hosting the job's etcd keeps it up until the others left (not when signalled); with
        several members, each removes its own unless it is the last (launch/etcdmembers.py)."""
        if self._members is not None:
            self._members.close(signalled=self._signal is not None, etcd_failed=self._etcd_failed)
        elif etcd is not None and store is not None and rdzv is not None and self._signal is None:
            wait_others_left(store, rdzv.keys.nodes, self.cfg.rendezvous.rdzv_close_timeout, self.say)

    def _settings(self, hosting: bool = False) -> RendezvousSettings:
        """The protocol's settings. ``hosting``: this agent runs the job's etcd (``--standalone``, or the
        host of a c10d/static line): it goes with the job, so nothing there needs to expire; the other
        agents of a hosted etcd record nothing when they leave (their host may stop it as they go)."""
        r = self.cfg.rendezvous
        hosted_elsewhere = not hosting and r.rdzv_backend in (RdzvBackend.C10D, RdzvBackend.STATIC)
        return RendezvousSettings(
            job_id=r.rdzv_id,
            min_nodes=r.nnodes_min,
            max_nodes=r.nnodes_max,
            max_restarts=r.max_restarts,
            restart_window=r.restart_window,
            heartbeat_timeout=r.heartbeat_timeout,
            stability_window=r.stability_window,
            rescale_timeout=r.rescale_timeout,
            join_timeout=r.join_timeout,
            stall_after=max(2.0, r.heartbeat_timeout / 2),
            busy_timeout=self.cfg.workers.shutdown_timeout + r.heartbeat_timeout + STOP_SLACK_S,
            ended_ttl=0.0 if hosting or hosted_elsewhere else self.cfg.etcd.ended_job_ttl,
            record_end=not hosted_elsewhere,
        )

    def _loop(self, rdzv: Rendezvous, workers: WorkerGroup) -> int:
        """Form a round, run it, form the next … until the job ends; the node's exit code."""
        inplace = self.inplace
        assert inplace is not None
        guard = OutageGuard(self.cfg, rdzv, workers, self.say)
        while True:
            workers.prewarm()
            self.obs.rendezvous(rdzv)
            try:
                guard.call(lambda: inplace.before_round(rdzv), "forming a round")
                topo = guard.call(rdzv.next_round, "forming a round")
            except LeaseLost as lost:
                inplace.drop()  # fencing: workers kept for an in-place re-form stop too
                self.say(f"lost our etcd lease ({lost}); rejoining")
                guard.call(rdzv.reregister, "rejoining")
                continue
            except JobEnded as ended:
                return self._ended(rdzv, ended)
            try:
                outcome = self._run_round(rdzv, workers, topo)
            except LeaseLost as lost:  # etcd answered an operation of the round: our lease is gone
                self.say(f"lost our etcd lease ({lost}): stopped our workers (fencing); rejoining")
                guard.call(rdzv.reregister, "rejoining")
                continue
            if outcome is RoundOutcome.SUCCEEDED:
                self.obs.finish("succeeded")
                self.say("all workers of all nodes finished: job succeeded")
                return ExitCode.SUCCEEDED

    def _ended(self, rdzv: Rendezvous, ended: JobEnded) -> int:
        self.obs.finish("succeeded" if ended.succeeded else "failed")
        outcome = str(ended.state.get("state", "failed"))
        if ended.spare:  # exits with the job's outcome, as its other nodes do (docs/deploy.md)
            self.say(f"job {self.cfg.rendezvous.rdzv_id!r} {outcome} while this node waited as a spare: "
                     "it ran no worker")
        if ended.succeeded:
            self.say("the job has finished successfully")
            return ExitCode.SUCCEEDED
        rows = rdzv.root_cause(int(ended.state.get("round", -1)))
        reason = ended.state.get("reason", "job failed")
        if rows:
            self.say.table(root_cause_table(rows, f"job {self.cfg.rendezvous.rdzv_id!r} failed: {reason}"))
        how = "stopped" if ended.stopped else "failed"
        err = JobFailedError(f"job {self.cfg.rendezvous.rdzv_id!r} {how}: {reason}")
        code = ended.state.get("exit_code")  # the node that ended the job chose it (absent: 1)
        err.exit_code = code if isinstance(code, int) else None
        raise err

    def _run_round(self, rdzv: Rendezvous, workers: WorkerGroup, topo: Topology) -> RoundOutcome:
        """Run our workers for ``topo`` until the round ends (launch/roundloop.py)."""
        assert self.inplace is not None
        loop = RoundLoop(self.cfg, rdzv, workers, topo, self.inplace, self.obs, self.say)
        loop.drain = None if self._stragglers is None else self._stragglers.drain_reason
        how = loop.start()
        self._round = topo.round  # from now on a graceful leave marks this round
        return loop.run(how, self._hang_watch(rdzv, topo))

    def _hang_watch(self, rdzv: Rendezvous, topo: Topology) -> Optional[HangWatch]:
        """``--hang-timeout``: watch the progress our node's local rank 0 reports (see launch/hang.py)."""
        if self.cfg.health.hang_timeout <= 0:
            return None
        if self._hang is None:
            key = rdzv.keys.progress_of(self.cfg.rendezvous.node_id)
            self._hang = HangWatch(lambda: read(rdzv.store.get(key), progress_record),
                                   self.cfg.health.hang_timeout).start()
        kept = self.cfg.rendezvous.node_id in topo.inplace  # our workers report round n - 1 until they re-form
        self._hang.start_round(topo.round, carried=topo.round - 1 if kept else None)
        return self._hang


def run_agent(cfg: LaunchConfig) -> int:
    """Validate ``cfg`` and run an agent; the exit code of the node."""
    cfg.validate()
    return Agent(cfg).run()


__all__: List[str] = ["Agent", "AgentSignal", "run_agent"]
