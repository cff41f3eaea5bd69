"""The local worker group: spawn one process per local rank, watch them, stop them.

Workers start in their own session (a process group we can signal as a whole) through
the parent-death shim of :mod:`elasticrun.proc`, so they never outlive the agent.
Call :meth:`WorkerGroup.start` from the agent's main thread (the parent-death signal
is tied to the spawning thread).
"""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

from elasticrun.job import env as names
from elasticrun.job.env import without_secrets
from elasticrun.launch.c10d import RoundStore
from elasticrun.launch.config import LaunchConfig
from elasticrun.launch.env import WorkerSpec, worker_env
from elasticrun.launch.failures import WorkerFailure, bounded, make_failure
from elasticrun.launch.forkserver import ForkedProcess, ForkServer, ServerState
from elasticrun.launch.hang import STACKS_SIGNAL
from elasticrun.launch.logfilter import FilteredCopy, feeder_for, open_filtered
from elasticrun.launch.logs import (
    STREAMS,
    TAIL_KEEP,
    OutputPump,
    console_for,
    join_all,
    line_prefix,
    on_console,
    run_log_dir,
    stream_selected,
    worker_log_dir,
)
from elasticrun.launch.preload import WAIT_FIRST_S, PreloadWatch, preload_first
from elasticrun.proc import kill_process_group, terminate_tree, with_parent_death_signal
from elasticrun.rendezvous.records import Member, RescaleEvent, Topology

ORDER_INLINE_MAX = 4096  # PIPE_BUF: a write this small into an empty pipe never blocks
STDERR_DRAIN_S = 1.0  # how long a failure summary waits for a dead worker's last stderr bytes
SERVER_WAIT_S = 60.0  # how long a later round's start waits for the fork server to finish its preload
STORE_MODULE = "elasticrun.launch.storeserver"


class GroupState(str, enum.Enum):
    """What this node's worker group is doing (:meth:`WorkerGroup.poll`)."""

    IDLE = "idle"  # no workers started
    RUNNING = "running"  # some still run, none failed
    SUCCEEDED = "succeeded"  # all exited 0
    FAILED = "failed"  # at least one exited non-zero


@dataclass
class _Worker:
    spec: WorkerSpec
    proc: subprocess.Popen
    err_pump: Optional[OutputPump] = None


def step_times_dir(files_dir: str) -> str:
    """The node's directory where each worker's StepTimer keeps its figure (elasticrun.train.steptime)."""
    path = os.path.join(files_dir, "step-times")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


class WorkerGroup:
    """This node's workers for one round at a time."""

    def __init__(
        self,
        cfg: LaunchConfig,
        node_label: str,
        files_dir: str,
        log_dir: Optional[str],
        use_gpu: bool,
        on_exit: Callable[[], None],
    ) -> None:
        self.cfg = cfg
        self.node_label = node_label
        self.files_dir = files_dir  # error files, event files (always written)
        self.log_dir = log_dir  # stdout/stderr copies (when asked for)
        self._run_log_dir: Optional[str] = None  # <log_dir>/<run_id>_<random>, made on first use
        self.use_gpu = use_gpu
        self._on_exit = on_exit
        self._workers: List[_Worker] = []
        self._pumps: List[OutputPump] = []
        self._warm: List[subprocess.Popen] = []
        self._server: Optional[ForkServer] = None
        self._retired: List[ForkServer] = []  # unsafe to fork from now, but its workers may still run
        self._fork_unsafe = "" if sys.platform.startswith("linux") else "not Linux"  # why not to fork
        self.started_how = ""  # how the last start() got its workers, for the agent's log line
        self._how: Dict[str, int] = {"forked": 0, "pre-warmed": 0, "fresh": 0}
        self._redirects, self._tee = cfg.std_streams()
        self.etcd_settings_file: Optional[str] = None  # the agent's 0600 EtcdSettings file, for workers
        self.extra_env: Dict[str, str] = {}  # more variables for every worker (e.g. the memory-tier directory)
        self.inplace = False  # name an assignment file to each worker (in-place re-forming)
        self.cpus: Dict[int, FrozenSet[int]] = {}  # --numa-binding: local rank → the CPUs its worker is bound to
        self._filtered: Dict[int, FilteredCopy] = {}  # this round's --duplicate-*-filters files, by stream
        self.round_store: Optional[RoundStore] = None  # served (by a store host) in the rounds this node leads
        self._rounds_started = 0  # the first round never waits for the fork server
        self._all_forked = False  # the last round's workers all came from the fork server
        self._deep_marker = os.path.join(files_dir, "deep-imports")  # a forked worker imported DDP's extras
        self._starting = threading.Lock()  # a start and a preload order never overlap
        self._preload_watch = PreloadWatch(self._starting)

    def command(self) -> List[str]:
        cfg = self.cfg
        if cfg.workers.no_python:
            return [cfg.workers.entrypoint, *cfg.workers.args]
        if cfg.workers.module:
            return [sys.executable, "-u", "-m", cfg.workers.entrypoint, *cfg.workers.args]
        return [sys.executable, "-u", cfg.workers.entrypoint, *cfg.workers.args]

    def prewarm(self, deep: bool = False, preload: bool = True) -> None:
        """Get interpreters that import torch ahead of time, to become workers when a round forms.

        With ``--standby`` 1 or more: the fork server (started bare once, kept; replaced if it
        died; with ``preload``, preloaded when the CPU is free: :meth:`_preload_server`), or where
        forking is unsafe, spawned interpreters. Called with ``deep`` while a round trains (the
        standby set for a restart: also what DDP loads on first use, torch._dynamo, ~1 s CPU), at
        most ``--standby`` of them; without, before a round forms, one per local rank. With
        ``--standby 0`` only the latter.
        """
        if not self.cfg.workers.prewarm or self.cfg.workers.no_python:
            return
        if self.cfg.workers.standby >= 1 and not self._fork_unsafe:
            self._start_server()
            if not self._fork_unsafe:
                if preload:
                    self._preload_server(deep)
                return
        w = self.cfg.workers
        wanted = min(w.standby, w.nproc_per_node) if deep else w.nproc_per_node
        self._warm = [p for p in self._warm if p.poll() is None]
        env = self._warm_env()
        # The script and its arguments only label the process (ps, pgrep); the real ones come on stdin.
        label = ["--", self.cfg.workers.entrypoint, *self.cfg.workers.args]
        flags = ["--deep"] if deep else []
        cmd = with_parent_death_signal([sys.executable, "-u", "-m", "elasticrun.launch.warm", *flags, *label])
        while len(self._warm) < wanted:
            self._warm.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
            )

    def _warm_env(self) -> Dict[str, str]:
        env = without_secrets(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.cfg.workers.nproc_per_node > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def _start_server(self) -> None:
        """Start the fork server unless one is starting or ready (a dead one is replaced)."""
        server = self._server
        if server is not None:
            if server.state is not ServerState.GONE:
                return
            if server.why_gone.startswith("not forking"):
                self._fork_unsafe = server.why_gone  # e.g. an import started a thread pool
                self._retired.append(server)  # closed with the group: closing kills its workers
            else:
                server.close()
            self._server = None
            if self._fork_unsafe:
                return
        env = self._warm_env()
        # No BLAS thread pool in the server: fork() would copy only the calling thread. A worker gets
        # its own environment (the order), but numpy's BLAS keeps the pool size it started with.
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        label = [self.cfg.workers.entrypoint, *self.cfg.workers.args]
        self._server = ForkServer(label, env, os.path.join(self.files_dir, "forkserver.log"), self.files_dir,
                                  preload_first=not self._rounds_started
                                  and preload_first(self.cfg.workers.nproc_per_node, os.environ))

    @property
    def server(self) -> Optional[ForkServer]:
        """The fork server, when this group has one (started by :meth:`prewarm`)."""
        return self._server

    def _preload_server(self, deep: bool) -> None:
        """Have the fork server preload when it takes no CPU from the workers (:mod:`preload`): torch,
        and DDP's extras where the script uses them (:meth:`_deep_wanted`).

        While this round's workers run: called with ``deep`` once they are past their start-up (the
        round loop's standby call), watch for an idle core; called without (a node joins: the round
        ends soon), now. While the node waits for a round: watch, after :data:`WAIT_FIRST_S`. A watch
        with nothing left to preload (torch is in, the extras not wanted yet) keeps watching.
        """
        server = self._server
        if server is None or server.deep:
            return

        def wanted() -> bool:  # something left to preload
            return not server.warm or self._deep_wanted()

        if self._workers and not deep:
            server.preload(self._deep_wanted())
        elif self._workers:
            self._preload_watch.start(lambda: server.preload(self._deep_wanted()),
                                      lambda: self._server is server and bool(self._workers), wanted=wanted)
        else:
            self._preload_watch.start(lambda: self._preload_between_rounds(server),
                                      lambda: self._server is server and not self._workers, first_s=WAIT_FIRST_S,
                                      wanted=wanted)

    def _preload_between_rounds(self, server: ForkServer) -> None:
        if server.state is ServerState.READY:
            server.preload(self._deep_wanted())

    def _deep_wanted(self) -> bool:
        """Whether the fork server should import DDP's extras too: a worker forked from it imported them
        (warm.py marks it), or this node's workers were not all forked (no mark: as if they had), or no round
        has run here yet. A script that never uses them leaves the server with torch alone."""
        return not self._rounds_started or not self._all_forked or os.path.exists(self._deep_marker)

    def _round_server(self) -> Optional[ForkServer]:
        """The fork server this round's workers come from, or None (they start another way).

        The first round does not wait for it (unless it imports torch first, on a host with few cores:
        :func:`~elasticrun.launch.preload.preload_first`): if it is not ready to fork (still starting, or
        preloading), its workers start directly, as torchrun's would. A later round waits for the
        preload to end (it began earlier and imports what a fresh worker would have to).
        """
        server = self._server
        if server is None or server.state is ServerState.READY:
            return server
        if not self._rounds_started and not server.preload_first:
            return None
        if server.wait_ready(SERVER_WAIT_S):
            return server
        if server.state is not ServerState.GONE:  # stuck in its imports: no round waits for it again
            server.close()
            self._server = None
        return None

    def _fork(self, server: ForkServer, order: Dict[str, object], fds: Sequence[int] = ()) -> Optional[ForkedProcess]:
        """A child forked from ``server`` for ``order``, or None (a server that is gone is closed: a spawn
        that timed out may still fork later, and no late child may run)."""
        forked = server.spawn(order, fds=fds)
        if forked is None and server.state is ServerState.GONE:
            server.close()
            if self._server is server:
                self._server = None
        return forked

    def host_store(self, fd: int, control: int, server: Optional[ForkServer] = None) -> object:
        """Start the process serving this round's c10d store on the listening socket ``fd`` (and,
        ordered over ``control``, the later rounds' this node leads): forked from ``server`` where it
        can fork (torch preloaded: ready in milliseconds), else ``python -m elasticrun.launch.storeserver``
        (its own torch import)."""
        assert self.round_store is not None
        timeout = self.round_store.timeout_s
        if server is not None and server.state is ServerState.READY:
            host = self._fork(server, {"store": {"timeout_s": timeout}}, fds=[fd, control])
            if host is not None:
                assert host.stdout is not None
                host.stdout.close()  # a store host writes only its error line, on stderr
                return host
        cmd = [sys.executable, "-m", STORE_MODULE, "--fd", str(fd), "--control", str(control),
               "--timeout", f"{timeout:g}"]
        return subprocess.Popen(with_parent_death_signal(cmd), env=self._warm_env(), pass_fds=(fd, control),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)

    def _serve_store(self, topo: Topology, member: Member, server: Optional[ForkServer]) -> None:
        """Leading round ``topo`` (group rank 0): have its c10d store served."""
        if self.round_store is not None and member.group_rank == 0:
            self.round_store.serve(topo.master_port, lambda fd, control: self.host_store(fd, control, server))

    def _spawn_all(self, envs: List[Dict[str, str]], cpus: Sequence[Optional[FrozenSet[int]]],
                   server: Optional[ForkServer]) -> List[subprocess.Popen]:
        """A worker per environment (bound to its ``cpus`` when given): all forked from ``server``,
        else all started another way (:meth:`_spawn`).

        When the fork server fails part-way, the workers it already forked die with it (it is
        closed): they are killed and started anew with the others, never left to die mid-round.
        """
        forked: List[subprocess.Popen] = []
        for env, bound in zip(envs, cpus):
            order = self._order(env, bound)
            if server is not None and not server.deep:
                order["deep_marker"] = self._deep_marker  # warm.py marks a script's use of DDP's extras
            proc = self._fork(server, order) if server is not None else None
            if proc is None:
                break
            forked.append(proc)  # type: ignore[arg-type]  # Popen's interface, as used here
        if len(forked) == len(envs):
            self._how["forked"] += len(forked)
            return forked
        for proc in forked:
            proc.kill()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        return [self._spawn(env, bound) for env, bound in zip(envs, cpus)]

    def _spawn(self, env: Dict[str, str], cpus: Optional[FrozenSet[int]] = None) -> subprocess.Popen:
        """A worker process for ``env`` without the fork server: a pre-warmed one, else a fresh one."""
        while self._warm:
            proc = self._warm.pop(0)
            if proc.poll() is not None or proc.stdin is None:
                continue
            try:
                proc.stdin.write(self._order_line(self._order(env, cpus)))
                proc.stdin.close()
                self._how["pre-warmed"] += 1
                return proc
            except (BrokenPipeError, OSError):
                continue
        self._how["fresh"] += 1
        # With --hang-timeout a fresh worker too starts through warm.py (no preload): it registers
        # the stack dump (see _order) before running the script exactly as `python script.py` would.
        boot = self.cfg.health.hang_timeout > 0 and not self.cfg.workers.no_python
        cmd = [sys.executable, "-u", "-m", "elasticrun.launch.warm", "--fresh", "--", self.cfg.workers.entrypoint,
               *self.cfg.workers.args] if boot else self.command()
        proc = subprocess.Popen(
            with_parent_death_signal(cmd, cpus=cpus or ()),
            env=env,
            stdin=subprocess.PIPE if boot else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        if boot and proc.stdin is not None:
            proc.stdin.write(self._order_line(self._order(env, cpus)))
            proc.stdin.close()
        return proc

    def _order(self, env: Dict[str, str], cpus: Optional[FrozenSet[int]] = None) -> Dict[str, object]:
        """What warm.py runs: the script, its environment, (``--hang-timeout``) the stack-dump signal and
        (``--numa-binding``) the CPUs to bind to first."""
        order: Dict[str, object] = {"env": env, "argv": [self.cfg.workers.entrypoint, *self.cfg.workers.args],
                                    "module": self.cfg.workers.module, "cwd": os.getcwd()}
        if self.cfg.health.hang_timeout > 0:
            order["stacks_signal"] = int(STACKS_SIGNAL)
        if cpus:
            order["cpus"] = sorted(cpus)
        return order

    def _order_line(self, order: Dict[str, object]) -> bytes:
        """The line a pre-warmed interpreter reads on stdin: the order itself, or where to find it.

        A pipe holds 64 KiB and the interpreter reads only once its imports are done, so a bigger
        write (a long argv or environment) would block the agent until then — or for good. Up to
        PIPE_BUF bytes go inline (never blocks on an empty pipe); more go through a private file.
        """
        data = (json.dumps(order) + "\n").encode()
        if len(data) <= ORDER_INLINE_MAX:
            return data
        fd, path = tempfile.mkstemp(prefix="order-", suffix=".json", dir=self.files_dir)  # mode 0600
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return (json.dumps({"order_file": path}) + "\n").encode()

    def discard_warm(self) -> None:
        """Stop the idle pre-warmed interpreters and the fork server (stop the workers first)."""
        self._preload_watch.changed()
        for server in [*self._retired, *([self._server] if self._server is not None else [])]:
            server.close()
        self._server, self._retired = None, []
        warm, self._warm = self._warm, []
        for proc in warm:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()

    @property
    def pids(self) -> List[int]:
        return [w.proc.pid for w in self._workers]

    @property
    def running(self) -> List[_Worker]:
        """This round's workers that have not exited."""
        return [w for w in self._workers if w.proc.poll() is None]

    def start(self, topo: Topology, member: Member, event: Optional[RescaleEvent]) -> None:
        """Spawn ``member.nproc`` workers for round ``topo`` (and, leading it, have its store served)."""
        assert not self._workers, "stop the previous workers first"
        with self._starting:
            self._preload_watch.changed()
            self._start(topo, member, event)

    def _start(self, topo: Topology, member: Member, event: Optional[RescaleEvent]) -> None:
        began = time.monotonic()
        self._how = {"forked": 0, "pre-warmed": 0, "fresh": 0}
        planned = self._plan(topo, member, event)
        if self._run_log_dir is not None:  # torchrun's filtered_{stdout,stderr}.log, made at the attempt's start
            self._filtered = open_filtered(self.cfg, os.path.join(self._run_log_dir, f"attempt_{topo.round}"))
        server = self._round_server()
        self._serve_store(topo, member, server)
        procs = self._spawn_all([env for _, env, _ in planned], [self.cpus.get(s.local_rank) for s, _, _ in planned],
                                server)
        self._rounds_started += 1
        self._all_forked = self._how["forked"] == len(procs)
        for (spec, _, rank_dir), proc in zip(planned, procs):
            log_dir = rank_dir if self.log_dir is not None else None
            err_pump = self._pump(proc, log_dir, spec.rank, spec.local_rank)
            self._workers.append(_Worker(spec, proc, err_pump))
            threading.Thread(target=self._wait, args=(proc,), daemon=True).start()
        kinds = ", ".join(f"{n} {kind}" for kind, n in self._how.items() if n)
        self.started_how = f"{kinds} in {(time.monotonic() - began) * 1000:.0f} ms"
        server = self._server
        why = self._fork_unsafe or (server.why_gone if server is not None else "")
        if why and not self._how["forked"] and self.cfg.workers.prewarm and self.cfg.workers.standby > 0:
            self.started_how += f"; no fork server: {why}"

    def _plan(self, topo: Topology, member: Member,
              event: Optional[RescaleEvent]) -> List[Tuple[WorkerSpec, Dict[str, str], str]]:
        """Each local worker's place and environment in round ``topo`` (its files made)."""
        round_dir = os.path.join(self.files_dir, f"attempt_{topo.round}")
        os.makedirs(round_dir, exist_ok=True)
        event_file = os.path.join(round_dir, "rescale_event.json")
        with open(event_file, "w") as f:
            json.dump(event.to_dict() if event else {}, f)
        planned: List[Tuple[WorkerSpec, Dict[str, str], str]] = []
        for local_rank in range(member.nproc):
            rank = member.rank_offset + local_rank
            rank_dir = self._worker_dir(round_dir, topo.round, rank, local_rank)
            spec = WorkerSpec(topo, member, local_rank, os.path.join(rank_dir, "error.json"), event_file)
            env = worker_env(
                os.environ,
                spec,
                run_id=self.cfg.rendezvous.rdzv_id,
                max_restarts=self.cfg.rendezvous.max_restarts,
                rdzv_endpoint=self.cfg.rendezvous.rdzv_endpoint,
                node_id=self.cfg.rendezvous.node_id,
                role=self.cfg.workers.role,
                event=event,
                backend=self.cfg.workers.backend,
                use_gpu=self.use_gpu,
                extra={
                    names.LR_SCALING: self.cfg.workers.lr_strategy.value,
                    names.REDISTRIBUTION: self.cfg.workers.redistribution.value,
                    names.GLOBAL_BATCH_SIZE: str(self.cfg.workers.global_batch_size or ""),
                    **self.extra_env,
                },
                etcd_settings_file=self.etcd_settings_file,
                virtual_local_rank=self.cfg.workers.virtual_local_rank,
            )
            env[names.PROGRESS_FILE] = os.path.join(self.files_dir, "progress-step")  # the node's, kept across rounds
            env[names.STEP_TIMES_DIR] = step_times_dir(self.files_dir)  # each rank's compute time per step
            if self.inplace:  # the assignment file of in-place re-forming (elasticrun.train.InPlace)
                env[names.INPLACE_FILE] = self.inplace_file(local_rank)
            planned.append((spec, env, rank_dir))
        return planned

    def inplace_file(self, local_rank: int) -> str:
        """Where local worker ``local_rank`` finds its next assignment (stable across rounds)."""
        return os.path.join(self.files_dir, f"inplace-{local_rank}")

    def adopt(self, topo: Topology, member: Member, event: Optional[RescaleEvent]) -> List[Dict[str, str]]:
        """Keep the running workers for round ``topo`` (in-place re-forming): their new environments.
        Leading the round, have its (new) store served."""
        planned = self._plan(topo, member, event)
        server = self._server
        self._serve_store(topo, member, server if server is not None and server.state is ServerState.READY else None)
        self._rounds_started += 1
        assert len(planned) == len(self._workers), "in place only with the same local workers"
        for w, (spec, _, _) in zip(self._workers, planned):
            w.spec = spec
        return [env for _, env, _ in planned]

    def _worker_dir(self, round_dir: str, round_: int, rank: int, local_rank: int) -> str:
        """Where a worker's error.json (and, with a log dir, its stdout/stderr.log) go."""
        if self.log_dir is None:
            path = os.path.join(round_dir, f"rank_{rank}")
        else:
            if self._run_log_dir is None:
                self._run_log_dir = run_log_dir(self.log_dir, self.cfg.rendezvous.rdzv_id)
            path = worker_log_dir(self._run_log_dir, round_, local_rank)
        os.makedirs(path, exist_ok=True)
        return path

    @property
    def run_log_dir(self) -> Optional[str]:
        """``<log_dir>/<run_id>_<random>`` once the first workers started with a log dir, else None."""
        return self._run_log_dir

    def _pump(self, proc: subprocess.Popen, log_dir: Optional[str], rank: int, local_rank: int) -> OutputPump:
        """Start copying a worker's stdout and stderr; returns the stderr pump (it keeps the tail)."""
        prefix = line_prefix(self.node_label, rank, local_rank, self.cfg.workers.role)
        shown = on_console(local_rank, self.cfg.logs.local_ranks_filter)
        pumps = []
        for stream, pipe in ((1, proc.stdout), (2, proc.stderr)):
            assert pipe is not None
            path = os.path.join(log_dir, f"{STREAMS[stream]}.log") if log_dir is not None else None
            on = shown and not stream_selected(self._redirects, local_rank, stream)
            console = console_for(stream) if on else None
            tap = feeder_for(self._filtered, self.cfg, local_rank, stream, prefix)
            pumps.append(OutputPump(pipe, prefix, console, path, keep_tail=TAIL_KEEP if stream == 2 else 0, tap=tap))
        self._pumps.extend(pumps)
        return pumps[1]

    def _wait(self, proc: subprocess.Popen) -> None:
        proc.wait()
        self._on_exit()

    def poll(self) -> GroupState:
        """RUNNING, SUCCEEDED (all exited 0), FAILED (any non-zero) or IDLE (none started)."""
        if not self._workers:
            return GroupState.IDLE
        codes = [w.proc.poll() for w in self._workers]
        if any(c is not None and c != 0 for c in codes):
            return GroupState.FAILED
        if all(c == 0 for c in codes):
            return GroupState.SUCCEEDED
        return GroupState.RUNNING

    def failures(self) -> List[WorkerFailure]:
        """The workers that exited non-zero (first to fail first when error files tell)."""
        out = []
        drain_until = time.monotonic() + STDERR_DRAIN_S
        for w in self._workers:
            code = w.proc.poll()
            if code is not None and code != 0:
                m = w.spec.member
                stderr = b""
                if w.err_pump is not None:
                    w.err_pump.join(max(0.0, drain_until - time.monotonic()))  # its last lines may still be in the pipe
                    stderr = w.err_pump.tail()
                out.append(make_failure(m.node_id, m.host, w.spec.rank, w.spec.local_rank, code, w.spec.error_file,
                                        stderr))
        return bounded(sorted(out, key=lambda f: f.timestamp))

    def kill_running(self) -> None:
        """SIGKILL every running worker's process group now (any thread): the round fails."""
        for w in list(self._workers):
            if w.proc.poll() is None:
                kill_process_group(w.proc.pid, signal.SIGKILL)

    def stop(self, grace: float, sig: int = signal.SIGTERM) -> None:
        """Signal every worker's process group, SIGKILL after ``grace`` s, and reap them all."""
        if not self._workers:
            return
        terminate_tree(self.pids, grace, sig)
        for w in self._workers:
            try:
                w.proc.wait(5)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        join_all(self._pumps)
        for copy in self._filtered.values():
            copy.close()
        self._workers, self._pumps, self._filtered = [], [], {}
        self._preload_watch.changed()

