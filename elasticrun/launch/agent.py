"""The node agent: join the job, run local workers for each round, re-form on any change.

    register → next_round → start workers → watch (workers, etcd) → stop → next_round …

One agent runs per node. It fences itself first whenever its lease is in doubt, so a
stale round never keeps training next to a new one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from rich.markup import escape

from elasticrun.config import LaunchConfig
from elasticrun.errors import ElasticrunError, JobFailedError
from elasticrun.launch.c10d import RoundStore
from elasticrun.launch.failures import root_cause_table
from elasticrun.launch.node import accelerators, gpu_available, local_address
from elasticrun.launch.workers import WorkerGroup
from elasticrun.models import NodeInfo, Topology, WorkerStatus
from elasticrun.rendezvous.protocol import JobEnded, LeaseLost, Rendezvous, RendezvousSettings
from elasticrun.store.client import EtcdStore, connect, parse_endpoints
from elasticrun.store.server import EtcdServer

STANDBY_DELAY_S = 2.0  # after a round starts, when to pre-warm the next round's workers


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
    console: Any = None

    def __post_init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False)

    def __call__(self, message: str) -> None:
        if not self.quiet:
            self.console.print(f"[cyan]elasticrun\\[{escape(self.label)}][/]: {escape(message)}", soft_wrap=True)

    def table(self, table: Any) -> None:
        self.console.print(table)


class Agent:
    """Runs one node of a job until it succeeds, fails for good, or is told to stop."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.label = cfg.node_id if "@" not in cfg.node_id else socket.gethostname()
        self.say = Reporter(self.label, quiet=cfg.quiet)
        self._signal: Optional[int] = None
        self._wake: Callable[[], None] = lambda: None

    # -- signals ----------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self._signal is None:
            self._signal = signum
            raise AgentSignal(signum)

    def _install_signals(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)

    # -- main ---------------------------------------------------------------------------------

    def run(self) -> int:
        """Run the job on this node; returns the process exit code."""
        cfg = self.cfg
        self._install_signals()
        etcd: Optional[EtcdServer] = None
        store: Optional[EtcdStore] = None
        rdzv: Optional[Rendezvous] = None
        workers: Optional[WorkerGroup] = None
        files_dir = tempfile.mkdtemp(prefix=f"elasticrun-{cfg.rdzv_id}-")
        round_store = RoundStore()
        try:
            log_dir = cfg.log_dir
            if log_dir is None and (cfg.redirects != "0" or cfg.tee != "0"):
                # Not under files_dir: that one is removed at exit, and these logs must outlive us.
                log_dir = tempfile.mkdtemp(prefix=f"elasticrun-logs-{cfg.rdzv_id}-")
                self.say(f"worker logs in {log_dir}")
            workers = WorkerGroup(cfg, self.label, files_dir, log_dir, False, on_exit=lambda: self._wake())
            workers.prewarm()  # worker interpreters import torch while we meet the other nodes
            if cfg.standalone and not cfg.rdzv_endpoint:
                etcd = EtcdServer(binary=cfg.etcd_binary).start()
                cfg.rdzv_endpoint = etcd.endpoint
                self.say(f"started a private etcd at {etcd.endpoint}")
            store = connect(
                cfg.rdzv_endpoint,
                user=cfg.etcd_user,
                password=cfg.etcd_password,
                ca_cert=cfg.etcd_cacert,
                cert_key=cfg.etcd_key,
                cert_cert=cfg.etcd_cert,
                retry_timeout=cfg.etcd_timeout,
            )
            host, port = parse_endpoints(cfg.rdzv_endpoint)[0]
            node = NodeInfo(
                node_id=cfg.node_id,
                host=socket.gethostname(),
                addr=cfg.local_addr or local_address(host, port),
                nproc=cfg.nproc_per_node,
                pid=os.getpid(),
            )
            rdzv = Rendezvous(store, self._settings(), node, round_store.fresh, on_progress=self.say)
            self._wake = rdzv.view.poke
            rdzv.ensure_config(cfg.job_settings())
            rdzv.register()  # before importing torch: a running job starts its stability window now
            use_gpu = cfg.device_kind == "gpu" or (cfg.device_kind == "auto" and gpu_available())
            workers.use_gpu = use_gpu
            rdzv.publish(accelerators=accelerators(use_gpu))
            self.say(
                f"joined job {cfg.rdzv_id!r} at {cfg.rdzv_endpoint} as {cfg.node_id} "
                f"(nnodes {cfg.nnodes_min}:{cfg.nnodes_max}, {cfg.nproc_per_node} workers)"
            )
            return self._loop(rdzv, workers)
        except AgentSignal as sig:
            self.say(f"received {sig}: stopping workers and leaving the job")
            if workers is not None:
                workers.stop(cfg.shutdown_timeout, sig=sig.signum)
            if rdzv is not None and rdzv.lease is not None:
                try:
                    rdzv.publish(status=WorkerStatus.LEAVING)
                except ElasticrunError:
                    pass
            return 128 + sig.signum
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            if workers is not None:
                workers.stop(cfg.shutdown_timeout)
                workers.discard_warm()
            round_store.close()
            if rdzv is not None:
                rdzv.leave()
            if store is not None:
                store.close()
            if etcd is not None:
                etcd.stop()
            shutil.rmtree(files_dir, ignore_errors=True)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def _settings(self) -> RendezvousSettings:
        c = self.cfg
        return RendezvousSettings(
            job=c.rdzv_id,
            min_nodes=c.nnodes_min,
            max_nodes=c.nnodes_max,
            max_restarts=c.max_restarts,
            heartbeat_timeout=c.heartbeat_timeout,
            stability_window=c.stability_window,
            rescale_timeout=c.rescale_timeout,
            join_timeout=c.join_timeout,
        )

    def _loop(self, rdzv: Rendezvous, workers: WorkerGroup) -> int:
        while True:
            workers.prewarm()
            try:
                topo = rdzv.next_round()
            except LeaseLost as lost:
                self.say(f"lost our etcd lease ({lost}); rejoining")
                rdzv.reregister()
                continue
            except JobEnded as ended:
                return self._ended(rdzv, ended)
            outcome = self._run_round(rdzv, workers, topo)
            if outcome == "succeeded":
                self.say("all workers of all nodes finished: job succeeded")
                return 0

    def _ended(self, rdzv: Rendezvous, ended: JobEnded) -> int:
        if ended.succeeded:
            self.say("the job has finished successfully")
            return 0
        rows = rdzv.root_cause(int(ended.state.get("round", -1)))
        reason = ended.state.get("reason", "job failed")
        if rows:
            self.say.table(root_cause_table(rows, f"job {self.cfg.rdzv_id!r} failed: {reason}"))
        raise JobFailedError(f"job {self.cfg.rdzv_id!r} failed: {reason}")

    def _run_round(self, rdzv: Rendezvous, workers: WorkerGroup, topo: Topology) -> str:
        """Run our workers for ``topo`` until the round ends; returns 'succeeded' or 'next'."""
        me = topo.member(self.cfg.node_id)
        assert me is not None
        event = rdzv.rescale_event(topo.round)
        ranks = f"{me.rank_offset}..{me.rank_offset + me.nproc - 1}"
        kind = event.type.value if event else "Start"
        self.say(
            f"round {topo.round} ({kind}): world size {topo.world_size}, {len(topo.members)} node(s), "
            f"group rank {me.group_rank}, ranks {ranks}, restarts {topo.restart_count}/{self.cfg.max_restarts}"
        )
        workers.start(topo, me, event)
        rdzv.publish(status=WorkerStatus.ACTIVE, waiting_for=-1)
        done_reported = False
        standby_at = time.monotonic() + STANDBY_DELAY_S
        version = rdzv.view.version
        while True:
            if standby_at and time.monotonic() >= standby_at:
                # A standby set of pre-warmed interpreters for the next round, started once this
                # round's workers are past their own start-up: a restart then skips the imports.
                workers.prewarm(deep=True)
                standby_at = 0.0
            if not rdzv.lease_valid():
                workers.stop(0.0, sig=signal.SIGKILL)  # fence first, talk later
                self.say("lost our etcd lease: stopped our workers (fencing); rejoining")
                rdzv.reregister()
                return "next"
            state = workers.poll()
            if state == "failed":
                failures = workers.failures()
                first = failures[0]
                self.say(f"worker rank {first.rank} failed ({first.signal or first.exitcode}): stopping this round")
                rdzv.report_failure(topo, [f.to_dict() for f in failures])  # first, so peers stop in parallel
                workers.stop(self.cfg.shutdown_timeout)
                return "next"
            if state == "succeeded" and not done_reported:
                rdzv.report_done(topo)
                rdzv.publish(status=WorkerStatus.SUCCEEDED)
                done_reported = True
            change = rdzv.round_change(topo)
            if change == "succeeded":
                rdzv.mark_succeeded(topo)
                workers.stop(self.cfg.shutdown_timeout)
                return "succeeded"
            if change is not None:
                self.say(f"round {topo.round} ended: {change}; stopping workers")
                workers.stop(self.cfg.shutdown_timeout)
                return "next"
            if not done_reported:
                due = rdzv.maybe_scale_up(topo)
                timeout = 0.5 if due is None else min(0.5, max(0.01, due))
            else:
                timeout = 0.5
            version = rdzv.view.wait_change(version, timeout)


def run_agent(cfg: LaunchConfig) -> int:
    """Validate ``cfg`` and run an agent; the exit code of the node."""
    cfg.validate()
    return Agent(cfg).run()


__all__: List[str] = ["Agent", "AgentSignal", "run_agent"]
