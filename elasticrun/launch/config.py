"""The agent's validated launch configuration (built by the CLI, read by the agent and its workers).

:class:`LaunchConfig` is built by the CLI from flags and checked by :meth:`validate`,
which raises :class:`~elasticrun.errors.ConfigError` with a one-line message naming the
flag and what to do. :meth:`job_settings` is what every node of a job must agree on.
"""

from __future__ import annotations

import enum
import math
import os
import re
import shutil
import signal
import socket
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from elasticrun.errors import ConfigError
from elasticrun.health.straggler import StragglerAction
from elasticrun.health.thresholds import Thresholds
from elasticrun.job.hints import AdaptationStrategy, RedistributionType
from elasticrun.job.inplace import READY_WAIT_S
from elasticrun.job.settings import from_options
from elasticrun.launch.gpus import VISIBLE_DEVICES, virtual_visible_device, visible_gpu_count
from elasticrun.rendezvous.ended import ETCD_MAX_TTL
from elasticrun.store.settings import EtcdSettings

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,200}$")


class RdzvBackend(str, enum.Enum):
    """Where the job's etcd comes from (``--rdzv-backend``)."""

    ETCD = "etcd"  # an etcd server at --rdzv-endpoint (etcd, etcd-v2, etcd-v3)
    C10D = "c10d"  # hosted by the agent whose address is the endpoint's host
    STATIC = "static"  # hosted by node rank 0 at --master-addr:--master-port (or the endpoint)


class Std(str, enum.Enum):
    """torchrun's ``--redirects``/``--tee`` code for one rank: which of its streams is selected."""

    NONE = "0"
    OUT = "1"  # stdout
    ERR = "2"  # stderr
    ALL = "3"  # both

    def selects(self, stream: int) -> bool:
        """Whether this code selects ``stream`` (1 stdout, 2 stderr)."""
        return self is Std.ALL or self.value == str(stream)


DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def parse_nnodes(spec: str, shown: str = "") -> Tuple[int, int]:
    """``"2"`` → (2, 2); ``"1:4"`` → (1, 4). Raises ConfigError naming ``shown`` (default ``--nnodes 'spec'``)."""
    text = str(spec).strip()
    shown = shown or f"--nnodes {spec!r}"
    lo, sep, hi = text.partition(":")
    try:
        mn = int(lo)
        mx = int(hi) if sep else mn
    except ValueError:
        raise ConfigError(f"{shown} is not N or MIN:MAX (e.g. --nnodes 2 or --nnodes 1:4)") from None
    if mn < 1:
        raise ConfigError(f"{shown}: MIN must be at least 1")
    if mn > mx:
        raise ConfigError(f"{shown}: MIN ({mn}) is larger than MAX ({mx}); use MIN:MAX with MIN <= MAX")
    return mn, mx


def parse_nproc(spec: str, shown: str = "") -> Tuple[int, str]:
    """``--nproc-per-node`` like torchrun: N, ``gpu``, ``cpu`` or ``auto``. Returns (n, device kind).
    Errors name ``shown`` (default ``--nproc-per-node 'spec'``)."""
    text = str(spec).strip().lower()
    shown = shown or f"--nproc-per-node {spec!r}"
    if text == "xpu":
        raise ConfigError(f"{shown}: elasticrun places workers on CUDA GPUs or CPUs; give a number")
    if text in ("gpu", "auto", "cpu"):
        gpus = visible_gpu_count() if text != "cpu" else 0  # torch.cuda.device_count(), without torch
        if text == "gpu":
            if gpus == 0:
                raise ConfigError(f"{shown}: no CUDA GPU visible on this node; use a number or 'cpu'")
            return gpus, "gpu"
        if text == "auto" and gpus > 0:
            return gpus, "gpu"
        return max(1, os.cpu_count() or 1), "cpu"
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"{shown} is not a number or one of gpu, cpu, auto") from None
    if n < 1:
        raise ConfigError(f"{shown}: need at least 1 worker per node")
    return n, "auto"


def default_node_id() -> str:
    """``<random>@<host>:<pid>`` — stable for this agent's lifetime, unique across restarts."""
    return f"{os.urandom(3).hex()}@{socket.gethostname()}:{os.getpid()}"


@dataclass
class RendezvousConfig:
    """How this node meets the others: the job's etcd, its size, the node's identity, the timings of
    forming rounds, restarts and in-place re-forming."""

    nnodes_min: int = 1
    nnodes_max: int = 1
    heterogeneous: bool = False  # allow nodes with different --nproc-per-node
    rdzv_endpoint: str = ""
    rdzv_id: str = "default"
    standalone: bool = False
    rdzv_backend: RdzvBackend = RdzvBackend.ETCD
    # c10d/static: whether this agent hosts the job's etcd at rdzv_endpoint; None = decide at start
    # (c10d: the endpoint's host is an address of this machine; static: node rank 0).
    rdzv_is_host: Optional[bool] = None
    rdzv_close_timeout: float = 30.0  # hosting agent: wait this long for the others to leave at the end
    etcd_members: int = 3  # c10d/static: the members the job's own etcd grows to (--rdzv-conf etcd_members; 1: no more)
    node_rank: Optional[int] = None  # --node-rank: the group rank this node keeps; None = any
    node_id: str = field(default_factory=default_node_id)
    local_addr: Optional[str] = None
    max_restarts: int = 0  # torchrun's default
    restart_window: float = 0.0  # --restart-window in seconds; 0 = max_restarts counts over the whole job
    heartbeat_timeout: float = 5.0
    stability_window: float = 1.0
    rescale_timeout: float = 60.0
    join_timeout: float = 600.0
    inplace: bool = True  # --no-inplace: every membership change restarts the workers (no in-place re-forming)
    inplace_ready_timeout: float = READY_WAIT_S  # --inplace-ready-timeout: newcomers' start-up allowance


@dataclass
class WorkersConfig:
    """What runs on this node and how: the script, the worker processes, the hints they get."""

    entrypoint: str = ""  # the script, module or command (checked by validate)
    args: List[str] = field(default_factory=list)
    module: bool = False
    no_python: bool = False
    nproc_per_node: int = 1
    device_kind: str = "auto"  # "gpu", "cpu" or "auto" (gpu when CUDA is available)
    role: str = "default"
    backend: Optional[str] = None
    shutdown_timeout: float = 30.0  # torchrun's default (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)
    monitor_interval: float = 0.1  # accepted like torchrun's; exits are noticed at once
    start_method: str = "spawn"  # accepted like torchrun's; workers of a script are new processes
    numa_binding: Optional[str] = None  # --numa-binding mode (elasticrun.launch.numa); None: no binding
    virtual_local_rank: bool = False  # every worker: LOCAL_RANK=0, CUDA_VISIBLE_DEVICES=its GPU
    signals_to_handle: List[str] = field(default_factory=lambda: list(DEFAULT_SIGNALS))
    prewarm: bool = True  # start worker interpreters (import torch) while the rendezvous settles
    standby: int = 1  # --standby N: warm interpreters per node (1: one fork server; 0: none)
    lr_strategy: AdaptationStrategy = AdaptationStrategy.LINEAR
    redistribution: RedistributionType = RedistributionType.INCREMENTAL
    global_batch_size: int = 0  # --global-batch-size (ELASTICRUN_GLOBAL_BATCH_SIZE); 0 = none


@dataclass
class EtcdConfig:
    """The etcd connection (users, TLS, retries), an etcd this node starts, and what outlives the job there."""

    etcd_user: Optional[str] = None
    etcd_password: Optional[str] = field(default=None, repr=False)  # never shown
    etcd_password_file: Optional[str] = None  # read by LaunchConfig.etcd_settings() (never passed on)
    etcd_cacert: Optional[str] = None
    etcd_cert: Optional[str] = None
    etcd_key: Optional[str] = None
    etcd_binary: Optional[str] = None
    etcd_timeout: float = 10.0  # seconds to keep retrying an unreachable etcd
    etcd_outage_grace: float = 60.0  # seconds workers keep training while etcd is unreachable
    ended_job_ttl: float = 7 * 86400.0  # --ended-job-ttl: seconds an ended job's keys stay in etcd (0: forever)


@dataclass
class HealthConfig:
    """Watching the job's health: hangs, the node check before joining, stragglers."""

    hang_timeout: float = 0.0  # --hang-timeout: restart a round whose progress stalled this long (0: off)
    node_check: bool = False  # --node-check: check the node before it joins (elasticrun.health)
    node_check_thresholds: Thresholds = field(default_factory=Thresholds)  # --node-check-thresholds
    straggler_threshold: float = 1.2  # --straggler-threshold: compute time over the job's median that is slow
    straggler_window: float = 30.0  # --straggler-window: seconds slow before a rank is a straggler
    straggler_action: StragglerAction = StragglerAction.WARN  # --straggler-action


@dataclass
class MemoryConfig:
    """The memory tier for workers' snapshots."""

    snapshots: bool = True  # --no-snapshots: no memory tier (no ELASTICRUN_SNAPSHOT_DIR for workers)
    snapshot_memory: Optional[int] = None  # --snapshot-memory: the memory tier's cap in bytes (None: the default cap)


@dataclass
class LogsConfig:
    """What the agent shows and records: workers' output, its own lines, events and metrics."""

    log_dir: Optional[str] = None
    redirects: str = Std.NONE.value  # torchrun's spec: one code, or per rank like 0:3,1:2
    tee: str = Std.NONE.value
    local_ranks_filter: Optional[List[int]] = None  # local ranks whose output the console shows; None = all
    duplicate_stdout_filters: List[str] = field(default_factory=list)  # tee'd lines containing one → a file
    duplicate_stderr_filters: List[str] = field(default_factory=list)
    event_log_handler: str = "null"
    quiet: bool = False
    events_file: Optional[str] = None  # --events-file: the agent's JSON-lines event log
    metrics_port: int = 0  # --metrics-port: serve /metrics there (0: off)
    metrics_host: str = "127.0.0.1"  # --metrics-host: the address /metrics listens on


@dataclass
class LaunchConfig:
    """Everything one agent needs to take part in a job, in groups (``cfg.rendezvous.heartbeat_timeout``).

    Each ``elasticrun run`` option names the field it fills as ``group.field``
    (:mod:`elasticrun.cli.run_options`); :meth:`of` builds a configuration from such paths."""

    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    logs: LogsConfig = field(default_factory=LogsConfig)

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> LaunchConfig:
        """A configuration from ``{"group.field": value}``, the rest defaults; TypeError names a path
        that is not a field."""
        groups: Dict[str, Dict[str, Any]] = {name: {} for name in GROUPS}
        for path, value in values.items():
            group, _, name = path.partition(".")
            if group not in groups or not name:
                raise TypeError(f"LaunchConfig has no field {path!r}")
            groups[group][name] = value
        return cls(**{group: GROUPS[group](**given) for group, given in groups.items()})

    def paths(self) -> Dict[str, Any]:
        """Every field as ``{"group.field": value}``."""
        return {f"{group}.{f.name}": getattr(getattr(self, group), f.name)
                for group in GROUPS for f in fields(GROUPS[group])}

    def validate(self) -> LaunchConfig:
        """Raise ConfigError with a clear message when something cannot work; return self.

        The checks run in :data:`CHECKS` order (the first failing one speaks)."""
        for check in CHECKS:
            check(self)
        return self

    def hosts_etcd(self) -> bool:
        """The job's agents run its etcd (torchrun's c10d and static lines): not one the user runs."""
        return not self.rendezvous.standalone and self.rendezvous.rdzv_backend in (RdzvBackend.C10D, RdzvBackend.STATIC)

    def keeps_log_files(self) -> bool:
        """Whether workers' output goes to files too (-r, -t, --duplicate-*-filters): they need a log dir."""
        return (self.logs.redirects != Std.NONE.value or self.logs.tee != Std.NONE.value
                or bool(self.logs.duplicate_stdout_filters or self.logs.duplicate_stderr_filters))

    def job_settings(self) -> Dict[str, Any]:
        """The settings every node of the job must share (stored once under ``config``)."""
        r, w = self.rendezvous, self.workers
        settings: Dict[str, Any] = {
            "nnodes": f"{r.nnodes_min}:{r.nnodes_max}",
            "entrypoint": w.entrypoint if w.module else os.path.basename(os.path.normpath(w.entrypoint)),
            "module": w.module,
            "no_python": w.no_python,
            "args": list(w.args),
            "max_restarts": r.max_restarts,
            "restart_window": r.restart_window,
            "heterogeneous": r.heterogeneous,
            "inplace_ready_timeout": r.inplace_ready_timeout,
        }
        if not r.heterogeneous:
            settings["nproc_per_node"] = w.nproc_per_node
        return settings

    def etcd_settings(self) -> EtcdSettings:
        """The etcd connection settings of ``--rdzv-endpoint`` and the ``--etcd-*`` flags, resolved (the
        password read from its flag, variable or file: ConfigError, one line, when unusable)."""
        return from_options(
            self.rendezvous.rdzv_endpoint, user=self.etcd.etcd_user, password=self.etcd.etcd_password,
            password_file=self.etcd.etcd_password_file, ca_cert=self.etcd.etcd_cacert, cert=self.etcd.etcd_cert,
            key=self.etcd.etcd_key, timeout=5.0, retry_timeout=self.etcd.etcd_timeout,
        )

    def std_streams(self) -> Tuple[Dict[int, Std], Dict[int, Std]]:
        """(redirects, tee) as {local_rank-or--1: :class:`Std`} maps; -1 = every rank."""
        return _parse_std_streams(self.logs.redirects, "--redirects"), _parse_std_streams(self.logs.tee, "--tee")


#: LaunchConfig's groups: its field name → the group's type.
GROUPS: Dict[str, type] = {"rendezvous": RendezvousConfig, "workers": WorkersConfig, "etcd": EtcdConfig,
                           "health": HealthConfig, "memory": MemoryConfig, "logs": LogsConfig}


def signal_number(name: str) -> int:
    """``"SIGTERM"`` → 15; ConfigError for a name that is not a signal the agent can handle."""
    sig = getattr(signal, str(name).strip().upper(), None)
    if not str(name).strip().upper().startswith("SIG") or not isinstance(sig, signal.Signals):
        raise ConfigError(f"--signals-to-handle: {name!r} is not a signal name (e.g. SIGTERM,SIGUSR1)")
    if sig in (signal.SIGKILL, signal.SIGSTOP):
        raise ConfigError(f"--signals-to-handle: {sig.name} cannot be handled; remove it")
    return int(sig)


_STD_CODES = tuple(code.value for code in Std)


def _parse_std_streams(spec: str, flag: str) -> Dict[int, Std]:
    """torchrun's ``--redirects``/``--tee`` syntax: ``3`` or ``0:1,1:2``. 1=stdout 2=stderr 3=both."""
    text = str(spec).strip()
    if text in _STD_CODES:
        return {-1: Std(text)}
    result: Dict[int, Std] = {}
    for part in text.split(","):
        rank, sep, value = part.partition(":")
        if not sep or not rank.strip().isdigit() or value.strip() not in _STD_CODES:
            raise ConfigError(
                f"{flag} {spec!r}: use 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per rank like 0:3,1:2"
            )
        result[int(rank)] = Std(value.strip())
    return result


# -- the checks of LaunchConfig.validate, one concept each --------------------------------------


@dataclass(frozen=True)
class Bound:
    """A number a field must satisfy: ``ok(value)``, else ConfigError(``message``), where ``{flag}``
    is the field's flag (``--nproc-per-node``) and ``{value}`` its value."""

    flag: str
    value: Callable[[LaunchConfig], Any]  # the field's value in a configuration
    ok: Callable[[Any], bool]
    message: str

    def check(self, cfg: LaunchConfig) -> None:
        value = self.value(cfg)
        if not self.ok(value):
            raise ConfigError(self.message.format(flag=self.flag, value=value))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _not_negative(flag: str, value: Callable[[LaunchConfig], float]) -> Bound:
    return Bound(flag, value, lambda v: v >= 0, "{flag} must not be negative")


COUNTS = (
    Bound("--standby", lambda c: c.workers.standby, lambda v: v >= 0,
          "{flag} {value}: must be 0 or more (0 turns standby interpreters off)"),
    Bound("--max-restarts", lambda c: c.rendezvous.max_restarts, lambda v: v >= 0, "{flag} {value}: must be 0 or more"),
    Bound("--global-batch-size", lambda c: c.workers.global_batch_size, lambda v: v >= 0,
          "{flag} {value}: must be 0 (none) or more"),
    Bound("--metrics-port", lambda c: c.logs.metrics_port, lambda v: 0 <= v <= 65535,
          "{flag} {value}: not a port; use 1-65535, or 0 for no metrics"),
)
DURATIONS = (  # seconds, checked after check_finite
    Bound("--restart-window", lambda c: c.rendezvous.restart_window, lambda v: v >= 0,
          "{flag} {value}: must not be negative (0: the whole job)"),
    Bound("--ended-job-ttl", lambda c: c.etcd.ended_job_ttl, lambda v: 0 <= v <= ETCD_MAX_TTL,
          "{flag} {value:g}s: must be 0 (keep forever) to " + f"{ETCD_MAX_TTL} seconds"),
    Bound("--hang-timeout", lambda c: c.health.hang_timeout, lambda v: v >= 0,
          "{flag} {value}: must not be negative (0 turns it off)"),
    Bound("--etcd-outage-grace", lambda c: c.etcd.etcd_outage_grace, lambda v: v >= 0,
          "{flag} {value}: must not be negative"),
    Bound("--heartbeat-timeout", lambda c: c.rendezvous.heartbeat_timeout, lambda v: v >= 2,
          "{flag} {value}: etcd leases need at least 2 seconds"),
    Bound("--inplace-ready-timeout", lambda c: c.rendezvous.inplace_ready_timeout, lambda v: v > 0,
          "{flag} {value}: must be more than 0 seconds"),
    Bound("--etcd-timeout", lambda c: c.etcd.etcd_timeout, lambda v: v > 0,
          "{flag} {value}: must be more than 0 seconds"),
    _not_negative("--stability-window", lambda c: c.rendezvous.stability_window),
    _not_negative("--rescale-timeout", lambda c: c.rendezvous.rescale_timeout),
    _not_negative("--join-timeout", lambda c: c.rendezvous.join_timeout),
    _not_negative("--shutdown-timeout", lambda c: c.workers.shutdown_timeout),
    _not_negative("--monitor-interval", lambda c: c.workers.monitor_interval),
)


def check_size(cfg: LaunchConfig) -> None:
    """``--nnodes MIN:MAX`` and ``--nproc-per-node``."""
    if cfg.rendezvous.nnodes_min < 1 or cfg.rendezvous.nnodes_min > cfg.rendezvous.nnodes_max:
        raise ConfigError(f"--nnodes {cfg.rendezvous.nnodes_min}:{cfg.rendezvous.nnodes_max}: need 1 <= MIN <= MAX")
    if cfg.workers.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node {cfg.workers.nproc_per_node}: need at least 1 worker per node")


def check_names(cfg: LaunchConfig) -> None:
    """``--rdzv-id`` and ``--node-id``: they become parts of etcd keys."""
    r = cfg.rendezvous
    if not _JOB_ID.match(r.rdzv_id):
        raise ConfigError(f"--rdzv-id {r.rdzv_id!r}: use letters, digits, '_', '.', '-' (at most 128 characters)")
    if not _NODE_ID.match(r.node_id):
        raise ConfigError(f"--node-id {r.node_id!r}: use letters, digits and _ . @ : - only")


def check_counts(cfg: LaunchConfig) -> None:
    """The counts (and the port) of :data:`COUNTS`."""
    for bound in COUNTS:
        bound.check(cfg)


def check_finite(cfg: LaunchConfig) -> None:
    """No nan or inf duration: a deadline that never comes."""
    for path, value in cfg.paths().items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{_flag(path.partition('.')[2])} {value}: must be a finite number of seconds")


def check_durations(cfg: LaunchConfig) -> None:
    """The durations of :data:`DURATIONS` (finite: :func:`check_finite` ran first)."""
    for bound in DURATIONS:
        bound.check(cfg)


def check_ranks(cfg: LaunchConfig) -> None:
    """``--node-rank`` below the node count; ``--local-ranks-filter`` not negative."""
    r = cfg.rendezvous
    if r.node_rank is not None and not 0 <= r.node_rank < r.nnodes_max:
        raise ConfigError(
            f"--node-rank {r.node_rank}: must be 0 .. {r.nnodes_max - 1} with --nnodes "
            f"{r.nnodes_min}:{r.nnodes_max} (give every node its own rank below the node count)"
        )
    for rank in cfg.logs.local_ranks_filter or []:
        if rank < 0:
            raise ConfigError(f"--local-ranks-filter: local rank {rank} must not be negative")


def check_signals(cfg: LaunchConfig) -> None:
    """``--signals-to-handle``: signal names the agent can handle."""
    for name in cfg.workers.signals_to_handle:
        signal_number(name)


def check_entrypoint(cfg: LaunchConfig) -> None:
    """The training script (a file, a directory with ``__main__.py``), a module, or a command."""
    if not cfg.workers.entrypoint:
        raise ConfigError("no training script given: elasticrun [options] script.py [script args]")
    if cfg.workers.module:
        return
    if cfg.workers.no_python:
        _check_command(cfg.workers.entrypoint)
        return
    if os.path.isdir(cfg.workers.entrypoint):  # python runs a directory's (or a zip's) __main__.py
        if not any(os.path.isfile(os.path.join(cfg.workers.entrypoint, f)) for f in ("__main__.py", "__main__.pyc")):
            raise ConfigError(f"training script {cfg.workers.entrypoint!r} is a directory without __main__.py: give "
                              "the script inside it, or -m for a package")
        return
    if not os.path.isfile(cfg.workers.entrypoint):
        raise ConfigError(
            f"training script {cfg.workers.entrypoint!r} not found (cwd {os.getcwd()}); "
            "use -m for a module or --no-python for a command"
        )


def _check_command(command: str) -> None:
    """``--no-python``: the command exists and this user may execute it."""
    if os.sep not in command:
        if shutil.which(command) is None:
            raise ConfigError(f"--no-python: command {command!r} not found on PATH")
        return
    if not os.path.exists(command):
        raise ConfigError(f"--no-python: command {command!r} does not exist")
    if os.path.isdir(command) or not os.access(command, os.X_OK):
        what = "a directory" if os.path.isdir(command) else "not executable"
        raise ConfigError(f"--no-python: {command!r} is {what}: make it executable (chmod +x), or "
                          "drop --no-python to run a Python script with python")


def check_rendezvous(cfg: LaunchConfig) -> None:
    """An etcd endpoint, or ``--standalone``."""
    if not cfg.rendezvous.standalone and not cfg.rendezvous.rdzv_endpoint:
        raise ConfigError(
            "no rendezvous: pass --rdzv-endpoint host:port (an etcd server; start one with "
            "`elasticrun etcd`) or --standalone for a single node"
        )


def check_etcd_members(cfg: LaunchConfig) -> None:
    """``--rdzv-conf etcd_members``: the size a hosted etcd grows to, an odd number."""
    if cfg.rendezvous.etcd_members not in (1, 3, 5, 7):
        raise ConfigError(f"--rdzv-conf etcd_members={cfg.rendezvous.etcd_members}: use 1, 3, 5 or 7 (an odd number: "
                          "an even one survives no more losses than the odd one below it)")


def check_streams(cfg: LaunchConfig) -> None:
    """``--redirects`` and ``--tee`` in torchrun's syntax."""
    cfg.std_streams()


def check_devices(cfg: LaunchConfig) -> None:
    """``--virtual-local-rank``: every local rank has a GPU of ``CUDA_VISIBLE_DEVICES`` to itself."""
    if cfg.workers.virtual_local_rank:
        for local_rank in range(cfg.workers.nproc_per_node):
            virtual_visible_device(local_rank, os.environ.get(VISIBLE_DEVICES))


#: What :meth:`LaunchConfig.validate` checks, in order.
CHECKS: Tuple[Callable[[LaunchConfig], None], ...] = (
    check_size, check_names, check_counts, check_finite, check_durations, check_ranks, check_etcd_members,
    check_signals, check_entrypoint, check_rendezvous, check_streams, check_devices,
)
