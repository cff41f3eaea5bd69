"""Validated configuration shared by all layers (ElasticTrainingConfig in DESIGN.md).

:class:`LaunchConfig` is built by the CLI from flags and checked by :meth:`validate`,
which raises :class:`~elasticrun.errors.ConfigError` with a one-line message naming the
flag and what to do. :meth:`job_settings` is what every node of a job must agree on.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from elasticrun.errors import ConfigError
from elasticrun.models import AdaptationStrategy, RedistributionType

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,200}$")


def parse_nnodes(spec: str) -> Tuple[int, int]:
    """``"2"`` → (2, 2); ``"1:4"`` → (1, 4). Raises ConfigError."""
    text = str(spec).strip()
    lo, sep, hi = text.partition(":")
    try:
        mn = int(lo)
        mx = int(hi) if sep else mn
    except ValueError:
        raise ConfigError(f"--nnodes {spec!r} is not N or MIN:MAX (e.g. --nnodes 2 or --nnodes 1:4)") from None
    if mn < 1:
        raise ConfigError(f"--nnodes {spec!r}: MIN must be at least 1")
    if mn > mx:
        raise ConfigError(f"--nnodes {spec!r}: MIN ({mn}) is larger than MAX ({mx}); use MIN:MAX with MIN <= MAX")
    return mn, mx


def parse_nproc(spec: str) -> Tuple[int, str]:
    """``--nproc-per-node`` like torchrun: N, ``gpu``, ``cpu`` or ``auto``. Returns (n, device kind)."""
    text = str(spec).strip().lower()
    if text in ("gpu", "auto", "cpu"):
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if text == "gpu":
            if gpus == 0:
                raise ConfigError("--nproc-per-node gpu: no CUDA GPU visible on this node; use a number or 'cpu'")
            return gpus, "gpu"
        if text == "auto" and gpus > 0:
            return gpus, "gpu"
        return max(1, os.cpu_count() or 1), "cpu"
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"--nproc-per-node {spec!r} is not a number or one of gpu, cpu, auto") from None
    if n < 1:
        raise ConfigError(f"--nproc-per-node {spec!r}: need at least 1 worker per node")
    return n, "auto"


def default_node_id() -> str:
    """``<random>@<host>:<pid>`` — stable for this agent's lifetime, unique across restarts."""
    return f"{os.urandom(3).hex()}@{socket.gethostname()}:{os.getpid()}"


@dataclass
class LaunchConfig:
    """Everything one agent needs to take part in a job."""

    entrypoint: str
    args: List[str] = field(default_factory=list)
    module: bool = False
    no_python: bool = False
    nnodes_min: int = 1
    nnodes_max: int = 1
    nproc_per_node: int = 1
    device_kind: str = "auto"  # "gpu", "cpu" or "auto" (gpu when CUDA is available)
    heterogeneous: bool = False  # allow nodes with different --nproc-per-node
    rdzv_endpoint: str = ""
    rdzv_id: str = "default"
    standalone: bool = False
    node_id: str = field(default_factory=default_node_id)
    local_addr: Optional[str] = None
    max_restarts: int = 3
    heartbeat_timeout: float = 5.0
    stability_window: float = 1.0
    rescale_timeout: float = 60.0
    join_timeout: float = 600.0
    shutdown_timeout: float = 5.0
    monitor_interval: float = 0.05
    log_dir: Optional[str] = None
    redirects: str = "0"
    tee: str = "0"
    role: str = "default"
    backend: Optional[str] = None
    lr_strategy: AdaptationStrategy = AdaptationStrategy.LINEAR
    redistribution: RedistributionType = RedistributionType.FULL_RESHUFFLE
    etcd_user: Optional[str] = None
    etcd_password: Optional[str] = None
    etcd_cacert: Optional[str] = None
    etcd_cert: Optional[str] = None
    etcd_key: Optional[str] = None
    etcd_binary: Optional[str] = None
    etcd_timeout: float = 10.0  # seconds to keep retrying an unreachable etcd
    quiet: bool = False
    prewarm: bool = True  # start worker interpreters (import torch) while the rendezvous settles

    def validate(self) -> LaunchConfig:
        """Raise ConfigError with a clear message when something cannot work; return self."""
        if self.nnodes_min < 1 or self.nnodes_min > self.nnodes_max:
            raise ConfigError(
                f"--nnodes {self.nnodes_min}:{self.nnodes_max}: need 1 <= MIN <= MAX"
            )
        if self.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node}: need at least 1 worker per node")
        if not _JOB_ID.match(self.rdzv_id):
            raise ConfigError(
                f"--rdzv-id {self.rdzv_id!r}: use letters, digits, '_', '.', '-' (at most 128 characters)"
            )
        if not _NODE_ID.match(self.node_id):
            raise ConfigError(f"--node-id {self.node_id!r}: use letters, digits and _ . @ : - only")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: must be 0 or more")
        if self.heartbeat_timeout < 2:
            raise ConfigError(
                f"--heartbeat-timeout {self.heartbeat_timeout}: etcd leases need at least 2 seconds"
            )
        if self.etcd_timeout <= 0:
            raise ConfigError(f"--etcd-timeout {self.etcd_timeout}: must be more than 0 seconds")
        for name in ("stability_window", "rescale_timeout", "join_timeout", "shutdown_timeout"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must not be negative")
        self._check_entrypoint()
        if not self.standalone and not self.rdzv_endpoint:
            raise ConfigError(
                "no rendezvous: pass --rdzv-endpoint host:port (an etcd server; start one with "
                "`elasticrun etcd`) or --standalone for a single node"
            )
        for name in ("redirects", "tee"):
            _parse_std_streams(getattr(self, name), f"--{name}")
        return self

    def _check_entrypoint(self) -> None:
        if not self.entrypoint:
            raise ConfigError("no training script given: elasticrun [options] script.py [script args]")
        if self.module:
            return
        if self.no_python:
            if os.sep not in self.entrypoint and shutil.which(self.entrypoint) is None:
                raise ConfigError(f"--no-python: command {self.entrypoint!r} not found on PATH")
            if os.sep in self.entrypoint and not os.path.exists(self.entrypoint):
                raise ConfigError(f"--no-python: command {self.entrypoint!r} does not exist")
            return
        if not os.path.isfile(self.entrypoint):
            raise ConfigError(
                f"training script {self.entrypoint!r} not found (cwd {os.getcwd()}); "
                "use -m for a module or --no-python for a command"
            )

    def job_settings(self) -> Dict[str, Any]:
        """The settings every node of the job must share (stored once under ``config``)."""
        settings: Dict[str, Any] = {
            "nnodes": f"{self.nnodes_min}:{self.nnodes_max}",
            "entrypoint": os.path.basename(self.entrypoint) if not self.module else self.entrypoint,
            "module": self.module,
            "no_python": self.no_python,
            "args": list(self.args),
            "max_restarts": self.max_restarts,
            "heterogeneous": self.heterogeneous,
        }
        if not self.heterogeneous:
            settings["nproc_per_node"] = self.nproc_per_node
        return settings

    def std_streams(self) -> Tuple[Dict[int, str], Dict[int, str]]:
        """(redirects, tee) as {local_rank-or--1: "0"/"1"/"2"/"3"} maps; -1 = every rank."""
        return _parse_std_streams(self.redirects, "--redirects"), _parse_std_streams(self.tee, "--tee")


def _parse_std_streams(spec: str, flag: str) -> Dict[int, str]:
    """torchrun's ``--redirects``/``--tee`` syntax: ``3`` or ``0:1,1:2``. 1=stdout 2=stderr 3=both."""
    text = str(spec).strip()
    if text in ("0", "1", "2", "3"):
        return {-1: text}
    result: Dict[int, str] = {}
    for part in text.split(","):
        rank, sep, value = part.partition(":")
        if not sep or not rank.strip().isdigit() or value.strip() not in ("0", "1", "2", "3"):
            raise ConfigError(
                f"{flag} {spec!r}: use 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per rank like 0:3,1:2"
            )
        result[int(rank)] = value.strip()
    return result


def describe_mismatch(existing: Dict[str, Any], mine: Dict[str, Any]) -> Optional[str]:
    """A one-line description of how ``mine`` differs from the job's settings, or None."""
    diffs = []
    for key in sorted(set(existing) | set(mine)):
        if existing.get(key) != mine.get(key):
            diffs.append(f"{key}: job has {existing.get(key)!r}, this node has {mine.get(key)!r}")
    return "; ".join(diffs) if diffs else None
