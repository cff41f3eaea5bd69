"""The local worker group: spawn one process per local rank, watch them, stop them.

Workers start in their own session (a process group we can signal as a whole) through
the parent-death shim of :mod:`elasticrun.proc`, so they never outlive the agent.
Call :meth:`WorkerGroup.start` from the agent's main thread (the parent-death signal
is tied to the spawning thread).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from elasticrun.config import LaunchConfig
from elasticrun.launch.env import WorkerSpec, worker_env
from elasticrun.launch.failures import WorkerFailure, make_failure
from elasticrun.launch.logs import STREAMS, LinePump, attempt_dir, console_stream, join_all, stream_selected
from elasticrun.models import Member, RescaleEvent, Topology
from elasticrun.proc import terminate_tree, with_parent_death_signal


@dataclass
class _Worker:
    spec: WorkerSpec
    proc: subprocess.Popen


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
        self.use_gpu = use_gpu
        self._on_exit = on_exit
        self._workers: List[_Worker] = []
        self._pumps: List[LinePump] = []
        self._warm: List[subprocess.Popen] = []
        self._redirects, self._tee = cfg.std_streams()

    def command(self) -> List[str]:
        cfg = self.cfg
        if cfg.no_python:
            return [cfg.entrypoint, *cfg.args]
        if cfg.module:
            return [sys.executable, "-u", "-m", cfg.entrypoint, *cfg.args]
        return [sys.executable, "-u", cfg.entrypoint, *cfg.args]

    def prewarm(self, deep: bool = False) -> None:
        """Start idle interpreters that import torch now, to become workers when the round forms.

        ``deep`` also imports what DDP loads on first use (torch._dynamo, ~1.5 s CPU): worth it for a
        standby set started while a round trains, not on the critical path of a starting round.
        """
        if not self.cfg.prewarm or self.cfg.no_python:
            return
        self._warm = [p for p in self._warm if p.poll() is None]
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.cfg.nproc_per_node > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        # The script and its arguments only label the process (ps, pgrep); the real ones come on stdin.
        label = ["--", self.cfg.entrypoint, *self.cfg.args]
        flags = ["--deep"] if deep else []
        cmd = with_parent_death_signal([sys.executable, "-u", "-m", "elasticrun.launch.warm", *flags, *label])
        while len(self._warm) < self.cfg.nproc_per_node:
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

    def _spawn(self, env: Dict[str, str]) -> subprocess.Popen:
        """A worker process for ``env``: a pre-warmed one when available, else a fresh one."""
        while self._warm:
            proc = self._warm.pop(0)
            if proc.poll() is not None or proc.stdin is None:
                continue
            order = {"env": env, "argv": [self.cfg.entrypoint, *self.cfg.args], "module": self.cfg.module,
                     "cwd": os.getcwd()}
            try:
                proc.stdin.write((json.dumps(order) + "\n").encode())
                proc.stdin.close()
                return proc
            except (BrokenPipeError, OSError):
                continue
        return subprocess.Popen(
            with_parent_death_signal(self.command()),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def discard_warm(self) -> None:
        """Stop the idle pre-warmed interpreters."""
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

    def start(self, topo: Topology, member: Member, event: Optional[RescaleEvent]) -> None:
        """Spawn ``member.nproc`` workers for round ``topo``."""
        assert not self._workers, "stop the previous workers first"
        round_dir = os.path.join(self.files_dir, f"attempt_{topo.round}")
        os.makedirs(round_dir, exist_ok=True)
        event_file = os.path.join(round_dir, "rescale_event.json")
        with open(event_file, "w") as f:
            json.dump(event.to_dict() if event else {}, f)
        for local_rank in range(member.nproc):
            rank = member.rank_offset + local_rank
            rank_dir = os.path.join(round_dir, f"rank_{rank}")
            os.makedirs(rank_dir, exist_ok=True)
            spec = WorkerSpec(topo, member, local_rank, os.path.join(rank_dir, "error.json"), event_file)
            env = worker_env(
                os.environ,
                spec,
                run_id=self.cfg.rdzv_id,
                max_restarts=self.cfg.max_restarts,
                rdzv_endpoint=self.cfg.rdzv_endpoint,
                node_id=self.cfg.node_id,
                role=self.cfg.role,
                event=event,
                backend=self.cfg.backend,
                use_gpu=self.use_gpu,
                extra={
                    "ELASTICRUN_LR_SCALING": self.cfg.lr_strategy.value,
                    "ELASTICRUN_REDISTRIBUTION": self.cfg.redistribution.value,
                },
            )
            proc = self._spawn(env)
            self._workers.append(_Worker(spec, proc))
            self._pump(proc, topo.round, rank, local_rank)
            threading.Thread(target=self._wait, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen, round_: int, rank: int, local_rank: int) -> None:
        prefix = f"[{self.node_label}/{rank}]:"
        for stream, pipe in ((1, proc.stdout), (2, proc.stderr)):
            path = None
            if self.log_dir is not None:
                path = os.path.join(attempt_dir(self.log_dir, self.cfg.rdzv_id, round_, rank), f"{STREAMS[stream]}.log")
            console = None if stream_selected(self._redirects, local_rank, stream) else console_stream(stream)
            self._pumps.append(LinePump(pipe, prefix, console, path))

    def _wait(self, proc: subprocess.Popen) -> None:
        proc.wait()
        self._on_exit()

    def poll(self) -> str:
        """``running``, ``succeeded`` (all exited 0), ``failed`` (any non-zero) or ``idle``."""
        if not self._workers:
            return "idle"
        codes = [w.proc.poll() for w in self._workers]
        if any(c is not None and c != 0 for c in codes):
            return "failed"
        if all(c == 0 for c in codes):
            return "succeeded"
        return "running"

    def failures(self) -> List[WorkerFailure]:
        """The workers that exited non-zero (first to fail first when error files tell)."""
        out = []
        for w in self._workers:
            code = w.proc.poll()
            if code is not None and code != 0:
                m = w.spec.member
                out.append(make_failure(m.node_id, m.host, w.spec.rank, w.spec.local_rank, code, w.spec.error_file))
        return sorted(out, key=lambda f: f.timestamp)

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
        self._workers, self._pumps = [], []

