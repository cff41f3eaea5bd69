"""``init()``: join the job's process group from the launcher's environment.

Works under ``elasticrun``, plain ``torchrun`` and a plain ``python train.py``: without
a launcher it creates a one-process group (so ``DistributedDataParallel`` and collectives
still work) unless told not to.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from elasticrun.errors import ConfigError
from elasticrun.job import env as job_env
from elasticrun.rendezvous.records import RescaleType
from elasticrun.sockets import OpenedSockets
from elasticrun.train.env import ElasticState
from elasticrun.train.signals import GracefulStop

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0
#: At the interpreter's exit, how long other threads may keep running before it finalizes (seconds).
EXIT_DRAIN_S = 0.5
TASKS_DIR = "/proc/self/task"
ENV_BACKEND = job_env.BACKEND


@dataclass
class ElasticContext:
    """What :func:`init` returns: who this worker is, on which device, and whether to stop."""

    state: ElasticState
    device: torch.device
    backend: Optional[str]
    stop: GracefulStop = field(default_factory=GracefulStop)
    owns_group: bool = False  # init() created the process group (and close() destroys it)
    cpu_group: Optional[Any] = None  # gloo group for CPU-side collectives when the default one is nccl
    # The sockets this round's groups opened (InPlace cuts them when the group breaks).
    group_sockets: OpenedSockets = field(default_factory=OpenedSockets)

    @property
    def cpu_process_group(self) -> Optional[Any]:
        """Group for collectives on CPU objects (checkpoint save/load, the stop/request
        agreement): a gloo group when the backend is nccl, else None (= the default group)."""
        return self.cpu_group

    @property
    def rank(self) -> int:
        return self.state.rank

    @property
    def world_size(self) -> int:
        return self.state.world_size

    @property
    def local_rank(self) -> int:
        return self.state.local_rank

    @property
    def local_world_size(self) -> int:
        return self.state.local_world_size

    @property
    def round(self) -> int:
        return self.state.round

    @property
    def rescale_type(self) -> RescaleType:
        return self.state.rescale_type

    @property
    def prev_world_size(self) -> int:
        return self.state.prev_world_size

    @property
    def is_rank0(self) -> bool:
        return self.state.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group is initialised (collectives can be called)."""
        return dist.is_available() and dist.is_initialized()

    @property
    def should_stop(self) -> bool:
        """True once this process got SIGTERM. Local only: agree on it before acting (see
        :class:`~elasticrun.train.control.CheckpointRequests`), or ranks will diverge."""
        return self.stop.requested

    def barrier(self) -> None:
        if self.distributed and dist.get_world_size() > 1:
            dist.barrier()

    def close(self) -> None:
        """Destroy the process group if :func:`init` created it and restore signal handlers."""
        self.stop.uninstall()
        if self.owns_group and self.distributed:
            dist.destroy_process_group()
            self.owns_group = False

    def __enter__(self) -> ElasticContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _collect_before_shutdown() -> None:
    """Collect cyclic garbage and let gloo's threads drop their last tensors while the interpreter is
    still fully alive (atexit runs before it finalizes).

    A thread that needs the GIL once the interpreter finalizes is ended by it, and when that thread is
    gloo's, inside a C++ destructor, the whole process aborts (``terminate called without an active
    exception``, exit -6 instead of the script's own code). Two ways lead there: a gloo group kept alive
    only by reference cycles (DDP's hooks, for one) destroyed by the final garbage collection, and a
    worker thread that releases the output tensors of a collective that already returned (an
    ``all_gather_object``'s, whose views of a Python tensor need the GIL to go) a moment after the
    script's last line, on a loaded host.
    """
    gc.collect()
    _let_threads_finish(EXIT_DRAIN_S)


def _runnable_threads(tasks_dir: str = TASKS_DIR) -> int:
    """How many threads of this process other than the calling one are running or ready to run (state
    ``R`` in ``/proc/self/task/*/stat``; 0 where that is not readable)."""
    me = str(threading.get_native_id())
    try:
        tids = [t for t in os.listdir(tasks_dir) if t != me]
    except OSError:
        return 0
    count = 0
    for tid in tids:
        try:
            with open(os.path.join(tasks_dir, tid, "stat"), encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue  # it ended meanwhile
        fields = stat[stat.rfind(")") + 2:].split()
        count += bool(fields) and fields[0] == "R"
    return count


def _let_threads_finish(limit_s: float, tasks_dir: str = TASKS_DIR) -> float:
    """Hand the GIL over (1 ms sleeps) until no other thread is runnable, at most ``limit_s``: a thread
    waiting for the GIL gets it at the first sleep, one that was still at work is seen runnable. The
    seconds it took."""
    start = time.monotonic()
    while True:
        time.sleep(0.001)
        waited = time.monotonic() - start
        if waited >= limit_s or not _runnable_threads(tasks_dir):
            return waited


def _mark_ready() -> None:
    """``<ELASTICRUN_INPLACE_FILE>.ready`` for a newcomer of an in-place round (ELASTICRUN_INPLACE_JOIN=1)."""
    path = os.environ.get(job_env.INPLACE_FILE, "").strip()
    if path and os.environ.get(job_env.INPLACE_JOIN) == "1":
        open(path + ".ready", "w").close()


def default_backend() -> str:
    """``nccl`` when CUDA is usable, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init(
    backend: Optional[str] = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    single_process_group: bool = True,
    stop_signals: Sequence[int] = (signal.SIGTERM,),
) -> ElasticContext:
    """Join the process group described by the environment and install the SIGTERM flag.

    - ``backend``: ``None`` takes the launcher's ``ELASTICRUN_BACKEND`` if set, else nccl on
      CUDA (binding the worker to GPU ``LOCAL_RANK``), else gloo.
    - ``timeout``: collective timeout in seconds.
    - ``single_process_group``: when not launched by elasticrun/torchrun, still create a
      world-1 group (in-memory store) so DDP works unchanged; ``False`` creates none.
    - ``stop_signals``: signals that set ``ctx.should_stop`` instead of killing the process
      (empty: leave signal handling alone).

    Calling it when a process group already exists reuses that group.
    """
    state = ElasticState.from_env()
    backend = backend or os.environ.get(ENV_BACKEND, "").strip() or default_backend()
    if "nccl" in backend:
        if not torch.cuda.is_available():
            raise ConfigError("backend nccl needs CUDA, but torch.cuda.is_available() is False: use gloo")
        ndev = torch.cuda.device_count()
        if state.local_rank >= ndev:
            raise ConfigError(
                f"LOCAL_RANK {state.local_rank} has no GPU (this node has {ndev}): lower --nproc-per-node"
            )
        torch.cuda.set_device(state.local_rank)
        device = torch.device("cuda", state.local_rank)
    else:
        device = torch.device("cpu")
    owns = False
    td = datetime.timedelta(seconds=timeout)
    sockets = OpenedSockets()
    if not dist.is_initialized():
        if state.launched:
            _mark_ready()  # an in-place newcomer: its start-up is over, the survivors may re-form now
            with sockets.watch():
                dist.init_process_group(backend=backend, init_method="env://", timeout=td)
            owns = True
        elif single_process_group:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=td)
            owns = True
    else:
        backend = dist.get_backend()
    if dist.is_initialized() and (dist.get_rank() != state.rank or dist.get_world_size() != state.world_size):
        # An existing group wins over the environment (e.g. a test created one by hand).
        state = replace(state, rank=dist.get_rank(), world_size=dist.get_world_size())
    if owns:
        atexit.unregister(_collect_before_shutdown)  # once, however often init() runs
        atexit.register(_collect_before_shutdown)
    cpu_group = None
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        with sockets.watch():
            cpu_group = dist.new_group(backend="gloo")  # collective: every rank creates it here
    stop = GracefulStop(stop_signals)
    if stop_signals:
        stop.install()
    ctx = ElasticContext(
        state=state, device=device, backend=backend if dist.is_initialized() else None, stop=stop, owns_group=owns,
        cpu_group=cpu_group, group_sockets=sockets,
    )
    if state.elastic and state.rank == 0:
        log.info("elasticrun: %s", state.describe())
    return ctx


__all__ = ["DEFAULT_TIMEOUT_S", "ElasticContext", "default_backend", "init"]
