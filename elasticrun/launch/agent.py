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
from typing import Any, Callable, List, Optional

from rich.text import Text

from elasticrun.errors import ElasticrunError, JobFailedError, StoreError
from elasticrun.job import env as env_names
from elasticrun.job.exitcodes import ExitCode, for_signal
from elasticrun.job.records import progress_record
from elasticrun.job.settings import drop_secrets_from_environment
from elasticrun.job.settings import from_config as etcd_settings
from elasticrun.launch.c10d import RoundStore
from elasticrun.launch.config import LaunchConfig, RdzvBackend, signal_number
from elasticrun.launch.failures import root_cause_table
from elasticrun.launch.hang import STACKS_WAIT_S, HangWatch, dump_stacks, hang_failures, hang_line, skip_grace
from elasticrun.launch.hosting import open_store, wait_others_left
from elasticrun.launch.inplace import InPlaceRounds
from elasticrun.launch.logfilter import unfed_warnings
from elasticrun.launch.node import local_address
from elasticrun.launch.numa import AffinityMode, describe_binding, worker_cpus
from elasticrun.launch.observe import Observer
from elasticrun.launch.outage import STOP_SLACK_S, OutageGuard, stop_workers
from elasticrun.launch.preload import TorchPreload
from elasticrun.launch.snapshots import SnapshotRoot
from elasticrun.launch.workers import SERVER_WAIT_S, GroupState, WorkerGroup
from elasticrun.rendezvous.protocol import JobEnded, LeaseLost, Rendezvous, RendezvousSettings
from elasticrun.rendezvous.records import NodeInfo, Topology, WorkerStatus
from elasticrun.rendezvous.states import RoundOutcome
from elasticrun.store.client import EtcdStore, parse_endpoints
from elasticrun.store.lease import LeaseHealth
from elasticrun.store.server import EtcdServer

STANDBY_DELAY_S = 2.0  # after a round starts, when to pre-warm the next round's workers


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
        self.label = cfg.node_id if "@" not in cfg.node_id else socket.gethostname()
        self.say = Reporter(self.label, quiet=cfg.quiet)
        self._signal: Optional[int] = None
        self._stopping = False  # set once the agent is stopping: no signal is raised again
        self._etcd_failed = False  # leaving on an etcd error: the teardown makes no call that waits on etcd
        self._wake: Callable[[], None] = lambda: None
        self._hang: Optional[HangWatch] = None  # --hang-timeout: made with the first round
        self.obs = Observer(cfg)  # /metrics, goodput accounting, --events-file
        self.inplace: Optional[InPlaceRounds] = None  # in-place re-forming (made with the workers)
        self._round = -1  # the round our workers run in (a graceful leave marks it)

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

    def _install_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for number in self._handled_signals():
                signal.signal(number, self._on_signal)

    def _handled_signals(self) -> List[int]:
        """--signals-to-handle (torchrun's default SIGTERM,SIGINT,SIGHUP,SIGQUIT); SIGTERM, SIGINT always."""
        numbers = {signal_number(name) for name in self.cfg.signals_to_handle}
        return sorted(numbers | {int(signal.SIGTERM), int(signal.SIGINT)})

    # -- main ---------------------------------------------------------------------------------

    def run(self) -> int:
        """Run the job on this node; returns the process exit code."""
        cfg = self.cfg
        self._install_signals()
        handled = self._handled_signals() if threading.current_thread() is threading.main_thread() else []
        etcd: Optional[EtcdServer] = None
        store: Optional[EtcdStore] = None
        rdzv: Optional[Rendezvous] = None
        workers: Optional[WorkerGroup] = None
        snapshots: Optional[SnapshotRoot] = None
        files_dir = tempfile.mkdtemp(prefix=f"elasticrun-{cfg.rdzv_id}-")
        round_store = RoundStore()
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
            teardown.callback(round_store.close)
            teardown.callback(lambda: workers is not None and self._stop_workers(workers))
            teardown.callback(self._ignore_signals, handled)
            try:
                self.obs.start()  # a busy --metrics-port: one line, before anything started
                log_dir = cfg.log_dir
                if log_dir is None and cfg.keeps_log_files():
                    # Not under files_dir: that one is removed at exit, and these logs must outlive us.
                    log_dir = tempfile.mkdtemp(prefix=f"elasticrun-logs-{cfg.rdzv_id}-")
                    self.say(f"worker logs in {log_dir}")
                drop_secrets_from_environment(cfg, self.say)  # before any child process starts
                workers = WorkerGroup(cfg, self.label, files_dir, log_dir, False, on_exit=lambda: self._wake())
                if cfg.numa_binding:  # torchrun's choice of each local rank's CPUs, once, before the job starts
                    workers.cpus = worker_cpus(AffinityMode(cfg.numa_binding), cfg.nproc_per_node)
                    self.say(describe_binding(AffinityMode(cfg.numa_binding), workers.cpus))
                for line in unfed_warnings(cfg):
                    self.say(line)
                self.inplace = InPlaceRounds(cfg, workers, self.say)
                if cfg.snapshots:
                    snapshots = SnapshotRoot.create(cfg.rdzv_id, cfg.node_id, say=self.say)  # the memory tier, ours
                if snapshots is not None:
                    workers.extra_env[env_names.SNAPSHOT_DIR] = snapshots.path
                    if cfg.snapshot_memory is not None:
                        workers.extra_env[env_names.SNAPSHOT_MEMORY] = str(cfg.snapshot_memory)
                workers.prewarm()  # worker interpreters import torch while we meet the other nodes
                torch_preload = TorchPreload(cfg.device_kind).start()  # our own torch too, while etcd starts
                etcd, store = open_store(cfg, self.say)  # standalone / c10d / static: may host the job's etcd
                self.obs.attach(store)
                # Workers reach etcd (commit fence, progress, checkpoint requests) with the same settings.
                workers.etcd_settings_file = etcd_settings(cfg).write(os.path.join(files_dir, "etcd-settings.json"))
                host, port = parse_endpoints(cfg.rdzv_endpoint)[0]
                node = NodeInfo(
                    node_id=cfg.node_id,
                    host=socket.gethostname(),
                    addr=cfg.local_addr or local_address(host, port),
                    nproc=cfg.nproc_per_node,
                    pid=os.getpid(),
                    node_rank=-1 if cfg.node_rank is None else cfg.node_rank,
                )
                rdzv = Rendezvous(store, self._settings(hosting=etcd is not None), node, round_store.fresh,
                                  on_progress=self.say)
                self._wake = rdzv.view.poke
                rdzv.on_beat = self._raise_pending_signal
                rdzv.ensure_config(cfg.job_settings())
                rdzv.register()  # before importing torch: a running job starts its stability window now
                rdzv.beat(busy_for=120.0)  # importing torch (bounded): not a stalled loop
                use_gpu, accs = torch_preload.result()
                workers.use_gpu = use_gpu
                if rdzv.lease_health() is LeaseHealth.LOST:
                    # The import can hold the GIL long enough on a loaded machine for the lease to lapse.
                    self.say("our etcd lease lapsed while importing torch; registering again")
                    rdzv.reregister()
                rdzv.publish(accelerators=accs)
                self.say(
                    f"joined job {cfg.rdzv_id!r} at {cfg.rdzv_endpoint} as {cfg.node_id} "
                    f"(nnodes {cfg.nnodes_min}:{cfg.nnodes_max}, {cfg.nproc_per_node} "
                    f"worker{'s' * (cfg.nproc_per_node != 1)})"
                )
                return self._loop(rdzv, workers)
            except StoreError:
                self._etcd_failed = True  # no final report, no revoke (the lease expires on its own)
                raise
            except AgentSignal as sig:
                self._stopping = True
                self.say(f"received {sig}: stopping workers and leaving the job")
                wsig = worker_signal(sig.signum)
                if rdzv is not None and self.inplace is not None and self.inplace.leave_first(rdzv, self._round, wsig):
                    wsig = 0  # signalled once already (a second SIGTERM kills); leave_first left the job
                if workers is not None:
                    workers.stop(cfg.shutdown_timeout, sig=wsig)
                if rdzv is not None:  # the job's end if we are its last node (rendezvous/ended.py)
                    rdzv.leaving(f"received {sig}", for_signal(sig.signum))
                if rdzv is not None and rdzv.lease is not None:
                    try:
                        if self._round >= 0:  # before the lease goes: survivors may re-form in place
                            rdzv.mark_left(self._round)
                        rdzv.publish(status=WorkerStatus.LEAVING)
                    except ElasticrunError:
                        pass
                return for_signal(sig.signum)  # drained: a retryable code (docs/deploy.md)
        raise AssertionError("unreachable")  # pragma: no cover - the block returns or raises

    # -- teardown steps of run() -----------------------------------------------------------------

    def _ignore_signals(self, handled: List[int]) -> None:
        """Leaving: from now on a second Ctrl-C must not interrupt the teardown."""
        self._stopping = True
        for number in handled:
            signal.signal(number, signal.SIG_IGN)

    def _restore_signals(self, handled: List[int]) -> None:
        for number in handled:
            signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)

    def _stop_workers(self, workers: WorkerGroup) -> None:
        workers.stop(self.cfg.shutdown_timeout)
        workers.discard_warm()

    def _wait_others_left(
        self, etcd: Optional[EtcdServer], store: Optional[EtcdStore], rdzv: Optional[Rendezvous]
    ) -> None:
        """The agent hosting the job's etcd keeps it up until the others left (not when signalled)."""
        if etcd is not None and store is not None and rdzv is not None and self._signal is None:
            wait_others_left(store, rdzv.keys.nodes, self.cfg.rdzv_close_timeout, self.say)

    def _settings(self, hosting: bool = False) -> RendezvousSettings:
        """The protocol's settings. ``hosting``: this agent runs the job's etcd (``--standalone``, or the
        host of a c10d/static line): it goes with the job, so nothing there needs to expire; the other
        agents of a hosted etcd record nothing when they leave (their host may stop it as they go)."""
        c = self.cfg
        hosted_elsewhere = not hosting and c.rdzv_backend in (RdzvBackend.C10D, RdzvBackend.STATIC)
        return RendezvousSettings(
            job_id=c.rdzv_id,
            min_nodes=c.nnodes_min,
            max_nodes=c.nnodes_max,
            max_restarts=c.max_restarts,
            restart_window=c.restart_window,
            heartbeat_timeout=c.heartbeat_timeout,
            stability_window=c.stability_window,
            rescale_timeout=c.rescale_timeout,
            join_timeout=c.join_timeout,
            stall_after=max(2.0, c.heartbeat_timeout / 2),
            busy_timeout=c.shutdown_timeout + c.heartbeat_timeout + STOP_SLACK_S,
            ended_ttl=0.0 if hosting or hosted_elsewhere else c.ended_job_ttl,
            record_end=not hosted_elsewhere,
        )

    def _loop(self, rdzv: Rendezvous, workers: WorkerGroup) -> int:
        guard = OutageGuard(self.cfg, rdzv, workers, self.say)
        while True:
            workers.prewarm()
            self.obs.rendezvous(rdzv)
            assert self.inplace is not None
            try:
                guard.call(lambda: self.inplace.before_round(rdzv), "forming a round")  # type: ignore[union-attr]
                topo = guard.call(rdzv.next_round, "forming a round")
            except LeaseLost as lost:
                self.inplace.drop()  # fencing: workers kept for an in-place re-form stop too
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
            self.say(f"job {self.cfg.rdzv_id!r} {outcome} while this node waited as a spare: it ran no worker")
        if ended.succeeded:
            self.say("the job has finished successfully")
            return ExitCode.SUCCEEDED
        rows = rdzv.root_cause(int(ended.state.get("round", -1)))
        reason = ended.state.get("reason", "job failed")
        if rows:
            self.say.table(root_cause_table(rows, f"job {self.cfg.rdzv_id!r} failed: {reason}"))
        err = JobFailedError(f"job {self.cfg.rdzv_id!r} {'stopped' if ended.stopped else 'failed'}: {reason}")
        code = ended.state.get("exit_code")  # the node that ended the job chose it (absent: 1)
        err.exit_code = code if isinstance(code, int) else None
        raise err

    def _run_round(self, rdzv: Rendezvous, workers: WorkerGroup, topo: Topology) -> RoundOutcome:
        """Run our workers for ``topo`` until the round ends."""
        me = topo.member(self.cfg.node_id)
        assert me is not None
        event = rdzv.rescale_event(topo.round)
        ranks = f"{me.rank_offset}..{me.rank_offset + me.nproc - 1}"
        kind = event.type.value if event else "Start"
        self.say(
            f"round {topo.round} ({kind}): world size {topo.world_size}, {len(topo.members)} node(s), "
            f"group rank {me.group_rank}, ranks {ranks}, restarts {topo.restart_count}/{self.cfg.max_restarts}"
        )
        rdzv.beat(busy_for=SERVER_WAIT_S)  # the start may wait for the fork server's imports (bounded)
        self.obs.round_started(topo, event)
        assert self.inplace is not None
        guard = OutageGuard(self.cfg, rdzv, workers, self.say)
        how = self.inplace.start(rdzv, topo, me, event, guard.call)
        self._round = topo.round
        rdzv.beat()
        self.say(f"round {topo.round}: workers started ({how})")
        guard.call(lambda: rdzv.publish(status=WorkerStatus.ACTIVE, waiting_for=-1), "starting a round")
        done_reported = False
        hang = self._hang_watch(rdzv, topo)
        standby_at = time.monotonic() + STANDBY_DELAY_S
        version = rdzv.view_version()
        while True:
            joining = rdzv.scale_up_pending(topo)
            if standby_at and (time.monotonic() >= standby_at or joining):
                # A standby set of pre-warmed interpreters for the next round, started once this
                # round's workers are past their own start-up: a restart then skips the imports.
                # A node joining ends the round within a stability window: warm up at once, and
                # only torch (not DDP's extras), so the standbys are ready when the round forms.
                workers.prewarm(deep=not joining)
                standby_at = 0.0
            rdzv.beat()  # liveness: the lease is refreshed only while this loop turns
            if _STALL and time.monotonic() >= _STALL[0]:
                time.sleep(_STALL.pop())  # test hook, once: a stalled main loop (ELASTICRUN_TEST_STALL_LOOP)
                _STALL.clear()
            if guard.check(topo) is not None:  # lease in doubt: ride out an etcd outage, or fence
                return RoundOutcome.NEXT
            self.obs.tick(rdzv, outage=guard.since is not None)
            state = workers.poll()
            if state is GroupState.FAILED:
                failures = workers.failures()
                first = failures[0]
                self.say(f"worker rank {first.rank} failed ({first.signal or first.exitcode}): stopping this round")
                self.obs.round_failed()
                rows = self.inplace.mark([f.to_dict() for f in failures])  # failed inside a re-form?
                guard.call(lambda: rdzv.report_failure(topo, rows), "reporting a failure")  # noqa: B023 - called at once
                stop_workers(rdzv, workers, self.cfg.shutdown_timeout)
                return RoundOutcome.NEXT
            if state is GroupState.RUNNING and self.inplace.tick(rdzv, topo, guard.call):
                return RoundOutcome.NEXT  # the re-form failed: reported as a failure, workers stopped
            if hang is not None and state is GroupState.RUNNING and hang.hung():
                self.say(f"round {topo.round}: the step reported by our workers (last {hang.step}) has not advanced "
                         f"for {hang.timeout:g} s: dumping every worker's Python stacks")
                self.obs.hang(topo, hang.step, hang.stalled_for())
                workers_now = workers.running
                rdzv.beat(busy_for=STACKS_WAIT_S)
                dump_stacks(workers_now)
                rows = hang_failures(workers_now, hang.timeout)
                self.say(f"{hang_line(rows, hang.timeout)}: stopping this round")
                guard.call(lambda: rdzv.report_failure(topo, rows), "reporting a hang")  # noqa: B023 - called at once
                # A hung worker (and its peers blocked in the collective) never reaches the step boundary
                # where a graceful stop would end it: no --shutdown-timeout wait, kill them now.
                stop_workers(rdzv, workers, 1.0, sig=signal.SIGKILL)
                return RoundOutcome.NEXT
            if state is GroupState.SUCCEEDED and not done_reported:
                guard.call(lambda: rdzv.report_done(topo), "reporting success")
                guard.call(lambda: rdzv.publish(status=WorkerStatus.SUCCEEDED), "reporting success")
                done_reported = True
            change = rdzv.round_change(topo)
            if change is RoundOutcome.SUCCEEDED:
                guard.call(lambda: rdzv.mark_succeeded(topo), "finishing the job")
                stop_workers(rdzv, workers, self.cfg.shutdown_timeout)
                return RoundOutcome.SUCCEEDED
            if change is not None:
                hung = hang is not None and self._hung_with_the_round(rdzv, topo, hang)
                if hung:  # another node saw the hang; ours wait in the collective with it
                    assert hang is not None
                    self.say(f"round {topo.round}: our workers' step has not advanced for "
                             f"{hang.stalled_for():.0f} s either: dumping their Python stacks")
                    workers_now = workers.running
                    rdzv.beat(busy_for=STACKS_WAIT_S)
                    dump_stacks(workers_now)
                    rows = hang_failures(workers_now, hang.timeout)
                    guard.call(lambda: rdzv.report_failure(topo, rows), "reporting a hang")  # noqa: B023 - called at once
                keep = not hung and self.inplace.keep(rdzv, topo)
                self.say(f"round {topo.round} ended: {change}; " + ("workers keep training until they re-form in place"
                                                                   if keep else "stopping workers"))
                self.obs.round_changed(rdzv, topo)
                if keep:
                    return RoundOutcome.NEXT
                if hung:  # stuck in a collective with the hung rank: a graceful stop would wait out its grace
                    stop_workers(rdzv, workers, 1.0, sig=signal.SIGKILL)
                else:
                    stop_workers(rdzv, workers, self.cfg.shutdown_timeout)
                return RoundOutcome.NEXT
            if not done_reported:
                due = rdzv.maybe_scale_up(topo)
                timeout = 0.5 if due is None else min(0.5, max(0.01, due))
            else:
                timeout = 0.5
            version = rdzv.wait_view(version, 0.02 if self.inplace.busy else timeout)


    def _hung_with_the_round(self, rdzv: Rendezvous, topo: Topology, hang: HangWatch) -> bool:
        """The round ended for a hang that another node detected, and our step stands still too: our
        workers are stuck with it and get no shutdown grace. Every other end gets the grace."""
        if hang.stalled_for() < hang.timeout / 2:
            return False
        try:
            rows = rdzv.root_cause(topo.round)
        except (ElasticrunError, ValueError, TypeError):
            return False  # cannot tell: the graceful stop (SIGKILL after the grace) is the safe side
        return skip_grace(hang.stalled_for(), hang.timeout, rows)

    def _hang_watch(self, rdzv: Rendezvous, topo: Topology) -> Optional[HangWatch]:
        """``--hang-timeout``: watch the progress our node's local rank 0 reports (see launch/hang.py)."""
        if self.cfg.hang_timeout <= 0:
            return None
        if self._hang is None:
            key = rdzv.keys.progress_of(self.cfg.node_id)
            self._hang = HangWatch(lambda: rdzv.store.get_record(key, progress_record), self.cfg.hang_timeout).start()
        kept = self.cfg.node_id in topo.inplace  # our workers report round n - 1 until they re-form
        self._hang.start_round(topo.round, carried=topo.round - 1 if kept else None)
        return self._hang


def _test_stall() -> List[float]:
    """``ELASTICRUN_TEST_STALL_LOOP=AFTER:SECONDS``: stall the round loop once, AFTER s after start (tests only)."""
    after, sep, seconds = os.environ.get(env_names.TEST_STALL_LOOP, "").partition(":")
    try:
        return [time.monotonic() + float(after), float(seconds)] if sep else []
    except ValueError:
        return []


_STALL = _test_stall()  # [when, seconds] until used


def run_agent(cfg: LaunchConfig) -> int:
    """Validate ``cfg`` and run an agent; the exit code of the node."""
    cfg.validate()
    return Agent(cfg).run()


__all__: List[str] = ["Agent", "AgentSignal", "run_agent"]
