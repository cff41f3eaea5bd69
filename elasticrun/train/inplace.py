"""In-place re-forming: survivors of a planned rescale keep their process, model and optimizer.

    ctx = et.init()
    inplace = et.InPlace(ctx, model=model, optimizer=opt, sampler=sampler)  # opts in
    ddp = DDP(model)                       # after InPlace, as every other collective
    while ...:
        try:
            train_one_step()               # zero_grad first, optimizer step after the last collective
        except RuntimeError as err:        # a peer crashed: its all-reduce failed
            if inplace.recover(err) is et.Reform.REFORMED:   # re-raises unless recovered in place
                ddp = et.rebuild_ddp(ddp)
                continue                   # redo the step in the re-formed group
            break                          # STOP
        inplace.step += 1                  # (and sampler.advance) only after the step's collectives
        result = inplace.check()           # a step boundary: one tiny all-reduce
        if result is et.Reform.STOP:       # this worker leaves (its node is going away)
            if reform.group_kept:          # every rank stops at this step: a collective save still works
                save()
            break
        if result is et.Reform.REFORMED:   # new world: rebuild what held the old group
            ddp = et.rebuild_ddp(ddp)

The agent writes this worker's next assignment (the next round's torchrun variables) to the
file named by ``ELASTICRUN_INPLACE_FILE`` (write + rename) instead of restarting the worker.
:meth:`InPlace.check` notices it with one ``os.stat``; all old-group ranks agree on the same
step through a MAX all-reduce of a local "pending" flag over a short-timeout gloo group, tear
the old group down, join the new round's group and broadcast the registered state from the new
rank 0 (always a survivor: ranks are stable) to newcomers, which receive it in the constructor
(``ELASTICRUN_INPLACE_JOIN=1``): create it before DDP or any other collective, so that a
newcomer's first collectives are the survivors' re-form (else both wait and the re-form fails).
Any failure (a peer gone, no assignment before ``timeout``) exits the worker with
:data:`EXIT_INPLACE_FAILED`: the agent then takes the normal restart path.
After a peer's crash the agent keeps the workers and says so in ``<file>.recover``: :meth:`InPlace.recover`
leaves the broken group, waits for the next assignment (the crashed rank's replacement joins as a
newcomer) and re-forms as above; the interrupted step is redone. A survivor's collective does not
always fail by itself: over NCCL its kernel waits on the dead peer, and over gloo a collective begun
after a peer died between two collectives was seen to wait for the group's timeout. So a watch thread
ends the round's groups when the agent says the round broke (gloo: their connections are cut; NCCL:
also aborted, and an optimizer step hook keeps the aborted collectives' partial results out of the
parameters; :mod:`elasticrun.train.abort`).
Without ``ELASTICRUN_INPLACE_FILE`` (torchrun, plain python) nothing changes: ``check()`` is a
no-op returning ``CONTINUE`` unless SIGTERM arrived.
"""

from __future__ import annotations

import copy
import datetime
import enum
import logging
import os
import sys
import time
from typing import Any, Dict, NoReturn, Optional, Tuple

import torch
import torch.distributed as dist

from elasticrun.errors import ConfigError
from elasticrun.job import env as names
from elasticrun.job.inplace import (
    ASSIGNED,
    EXIT_INPLACE_FAILED,
    collectives_broken,
    formed_round,
    opted_in,
    read_assignment,
    recovery_announced,
    write_assignment,
)
from elasticrun.train.abort import BreakWatch, abort_all_groups, finish
from elasticrun.train.dist import ElasticContext
from elasticrun.train.env import ElasticState
from elasticrun.train.progress import follow_reform
from elasticrun.train.sampler import ElasticDistributedSampler

log = logging.getLogger(__name__)

DEFAULT_REFORM_TIMEOUT_S = 30.0
DEFAULT_JOIN_TIMEOUT_S = 120.0
_STOP = 2  # flag value: this rank leaves (SIGTERM); 1: an assignment is pending; 0: nothing
#: A vote where some ranks stop and others not yet: how long the others wait for their own SIGTERM before
#: the stopping ranks leave alone. A whole-job stop (scancel, the job's pods deleted) reaches the nodes a
#: little apart; within this grace it is one stop at one step, every rank saving together. A single node's
#: graceful leave costs nothing more: its survivors stop waiting as soon as their next assignment is written.
STOP_GRACE_S = 2.0


class Reform(enum.Enum):
    """What :meth:`InPlace.check` decided at this step boundary."""

    CONTINUE = "continue"  # nothing changed
    REFORMED = "reformed"  # now in the next round's group, state synchronised
    STOP = "stop"  # this worker leaves (SIGTERM): save if you must, then exit 0


#: What a failed collective's error says (gloo names its sources; a peer's end shows as a closed or reset
#: connection); any other error of a step is a bug in the step and is re-raised at once.
_BROKEN_COLLECTIVE = ("gloo", "Connection closed", "Connection reset", "Broken pipe", "Socket Timeout")


def broken_collective(err: BaseException) -> bool:
    """Whether ``err`` is a collective broken by a peer (a ``torch.distributed`` error, or gloo's
    ``RuntimeError`` about its connections) rather than an error of the step's own code."""
    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and any(mark in str(err) for mark in _BROKEN_COLLECTIVE)


def rebuild_ddp(module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """A DDP wrapper on the current (new) process group around the module ``module`` wrapped.

    A DDP wrapper holds the old group: after :attr:`Reform.REFORMED`, wrap again.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    inner = module.module if isinstance(module, DDP) else module
    return DDP(inner, **kwargs)


class InPlace:
    """Registered training state plus the step-boundary check; see the module docstring.

    ``objects``: things with ``state_dict()``/``load_state_dict()`` (model, optimizer, sampler…)
    broadcast to newcomers. ``step`` and ``extra`` (a JSON-able dict) travel too. ``every``: run
    the agreement every K steps (K=1: one 1-element all-reduce per step; a SIGTERM is acted on at the next
    of those steps, as every rank must join the same votes). ``timeout``: the
    deadline of the re-form's own collectives and of the wait for the assignment; ``join_timeout``:
    how long the new group may take to assemble (newcomers are still starting: their imports count)
    and the collective timeout of the new default group.

    Over NCCL every registered ``torch.optim.Optimizer`` gets a step pre-hook that waits for the step's
    collectives on the device (one synchronisation of the current stream per optimizer step) and raises
    ``torch.distributed.DistBackendError`` instead of applying the step when a peer's crash aborted them.
    """

    def __init__(self, ctx: ElasticContext, *, every: int = 1, timeout: float = DEFAULT_REFORM_TIMEOUT_S,
                 join_timeout: float = DEFAULT_JOIN_TIMEOUT_S, **objects: Any) -> None:
        self.ctx = ctx
        self.objects = objects
        _refuse_sharded(objects)
        self.step = 0
        self.extra: Dict[str, Any] = {}
        self.every = max(1, int(every))
        self.timeout = float(timeout)
        self.join_timeout = float(join_timeout)
        self.path = os.environ.get(names.INPLACE_FILE, "").strip()
        self.last_pause_s = 0.0  # wall time of the last re-form (teardown → state synchronised)
        self.reforms = 0
        self.recoveries = 0  # re-forms after a peer's crash (:meth:`recover`)
        self.joined = False  # this newcomer received the registered state from the survivors (constructor)
        self.group_kept = False  # after STOP: every rank stops at this step, the group still works (save now)
        self._calls = 0
        self._seen: Optional[int] = None
        self._group: Any = None
        self._watch: Optional[BreakWatch] = None  # ends a broken round's groups (see the module docstring)
        if self.enabled:
            with self.ctx.group_sockets.watch():
                self._new_group()
            self._watch = BreakWatch(lambda: self.ctx.round, lambda r: collectives_broken(self.path, r))
            self._arm()
            if self._nccl:
                self._gate_optimizers()
            self._watch.start()
            if os.environ.get(names.INPLACE_JOIN) == "1":
                os.environ.pop(names.INPLACE_JOIN, None)
                self._guarded(self.sync, "receiving the state from the survivors")
                self.joined = True
            self._mark()  # tell the agent: restart not needed

    @property
    def enabled(self) -> bool:
        """True under an agent that re-forms in place, with a process group."""
        return bool(self.path) and self.ctx.distributed

    @property
    def _nccl(self) -> bool:
        return "nccl" in str(self.ctx.backend)

    @property
    def _aborted(self) -> bool:
        """This round's groups were aborted: a peer crashed (NCCL; see :mod:`elasticrun.train.abort`)."""
        return self._watch is not None and self._watch.fired

    # -- the step boundary -------------------------------------------------------------------

    def _pending(self) -> bool:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return False
        if mtime == self._seen:
            return False
        a = read_assignment(self.path)
        if a is None:
            return False
        self._seen = mtime
        return int(a["round"]) > self.ctx.round

    def check(self) -> Reform:
        """Call once per step, on every rank, between steps. Collective when enabled."""
        self._calls += 1
        if not self.enabled:
            return Reform.STOP if self.ctx.should_stop else Reform.CONTINUE
        if self._calls % self.every and not self._aborted:  # every rank votes at the same calls, stopping or not
            return Reform.CONTINUE
        if self._aborted:  # our groups are gone: no agreement over them
            return self._recover_at_check(dist.DistBackendError(f"round {self.ctx.round}'s groups were aborted"))
        stopping = self.ctx.should_stop  # read once: SIGTERM may land between here and the decision
        pending = not stopping and self._pending()
        try:
            highest, lowest = self._vote(_STOP if stopping else int(pending))
            if highest == _STOP and lowest != _STOP:  # some ranks stop: is the whole job stopping?
                stopping, pending = self._await_own_stop(stopping, pending)
                highest, lowest = self._vote(_STOP if stopping else int(pending))
        except Exception as err:  # a peer crashed: recover in place if the agent keeps us, else the restart path
            return self._recover_at_check(err)
        if highest == 0:
            return Reform.CONTINUE
        if stopping:
            if lowest == _STOP:  # every rank stops here: the job's end, keep the group to save
                self.group_kept = True
                return Reform.STOP
            self._leave_group()
            return Reform.STOP
        return Reform.REFORMED if self._reform() else Reform.STOP

    def _vote(self, mine: int) -> Tuple[int, int]:
        """One MAX all-reduce over the old group: the highest flag of the ranks and the lowest."""
        flags = torch.tensor([mine, -mine])
        finish(dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group, async_op=True), self._group)
        return int(flags[0].item()), -int(flags[1].item())

    def _await_own_stop(self, stopping: bool, pending: bool) -> Tuple[bool, bool]:
        """After a vote where some ranks stop: wait up to :data:`STOP_GRACE_S` for this rank's own SIGTERM
        (a whole-job stop), unless the next round's assignment comes first (only those nodes leave).
        Returns ``(stopping, pending)`` for the second vote."""
        deadline = time.monotonic() + min(STOP_GRACE_S, self.timeout / 2)  # well inside the vote's own deadline
        while not (stopping or pending) and time.monotonic() < deadline:
            time.sleep(0.005)
            stopping = self.ctx.should_stop
            pending = self._pending()
        return stopping, pending

    def _recover_at_check(self, err: Exception) -> Reform:
        """The agreement's all-reduce failed: :meth:`recover`, or exit for a restart when not recovered."""
        try:
            return self.recover(err if isinstance(err, RuntimeError) else RuntimeError(str(err)))
        except Exception as again:
            self._fail(f"agreeing to re-form failed: {again}")

    # -- the re-form ----------------------------------------------------------------------------

    def _reform(self) -> bool:
        """Leave the old group, join the next round's; False: SIGTERM came while waiting (leave)."""
        began = time.monotonic()
        old = self.ctx.round
        self._leave_group()
        a = self._await_assignment(old, self.timeout)
        if a is None:
            return False
        self._enter(a, began)
        return True

    def _await_assignment(self, old: int, within: float) -> Optional[Dict[str, Any]]:
        """The assignment for a round after ``old`` (None: SIGTERM came first); fails the worker after ``within`` s."""
        deadline = time.monotonic() + within
        a = read_assignment(self.path)
        while a is None or int(a["round"]) <= old:
            if self.ctx.should_stop:  # our node leaves too (its agent left first): no assignment will come
                self.ctx.owns_group = False
                return None
            if time.monotonic() >= deadline:
                self._fail(f"no assignment for a round after {old} within {within:g} s")
            time.sleep(0.005)
            a = read_assignment(self.path)
        return a

    def _enter(self, a: Dict[str, Any], began: float) -> None:
        """Join the round of assignment ``a`` (the old group is gone) and synchronise the state from rank 0."""
        if a.get("leave"):
            self._fail(f"round {a['round']} has no place for this worker")
        os.environ.update(a["env"])
        state = ElasticState.from_env()
        if self.ctx.device.type == "cuda" and state.local_rank != self.ctx.device.index:
            self._fail(f"LOCAL_RANK changed from {self.ctx.device.index} to {state.local_rank} (its GPU is bound)")
        self.ctx.state = state
        self._guarded(self._join_group, "joining the new round's group (a newcomer that ran DDP or another "
                      "collective before creating InPlace blocks it)")
        self._arm()
        self._repoint_samplers(state)
        self._guarded(self.sync, "sending the state to newcomers")
        follow_reform(state)  # progress reports (hang detection, the step gauge) name the new round
        self.reforms += 1
        self.last_pause_s = time.monotonic() - began
        self._mark()
        log.info("elasticrun: re-formed in place: round %d, rank %d of %d (%.3f s)",
                 state.round, state.rank, state.world_size, self.last_pause_s)

    # -- recovery from a peer's crash ---------------------------------------------------------------

    def recover(self, err: BaseException) -> Reform:
        """The step raised ``err``; call from its ``except`` block, on the rank it raised on.

        A peer crashed (gloo: its closed connection; or a collective deadline; NCCL: the round's groups
        were aborted on the agent's word, see :mod:`elasticrun.train.abort`): this worker leaves the
        broken group at once (its peers' pending collectives fail too; NCCL: its communicators are
        aborted, never flushed) and, when its agent keeps the workers for an in-place recovery
        (``<file>.recover`` within ``timeout`` s), waits for the next round's assignment (the crashed
        rank's replacement starting), joins it and receives the state from the new rank 0:
        :attr:`Reform.REFORMED`, redo the interrupted step (its gradients are dropped; the sampler and
        :attr:`step` were not advanced). :attr:`Reform.STOP`: SIGTERM came while waiting (the agent took
        the restart path). Re-raises ``err`` otherwise: not enabled, or no recovery announced. An error
        that is no broken collective (:func:`broken_collective`: e.g. a shape mismatch in the step) is
        re-raised at once, without waiting, unless this round's groups were aborted.
        """
        if not self.enabled or not (broken_collective(err) or self._aborted):
            raise err
        began = time.monotonic()
        old = self.ctx.round
        log.warning("elasticrun: a collective of round %d failed (%s): waiting for an in-place recovery",
                    old, str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
        self._drop_group()
        wait = self._await_recovery(old, began + self.timeout)
        if wait is None:
            if self.ctx.should_stop:
                return Reform.STOP
            raise err
        a = self._await_assignment(old, wait)
        if a is None:
            return Reform.STOP
        self._enter(a, began)
        self.recoveries += 1
        return Reform.REFORMED

    def _await_recovery(self, old: int, deadline: float) -> Optional[float]:
        """Seconds the agent allows for the next assignment once it announces it keeps us (None: SIGTERM, or
        nothing announced by ``deadline``)."""
        while not self.ctx.should_stop:
            wait = recovery_announced(self.path, old)
            if wait is not None:
                return wait
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)
        return None

    def _drop_group(self) -> None:
        """Leave a broken group: its connections are cut first (``OpenedSockets``: peers blocked on us fail
        at once, though a reference the script holds keeps the group alive), once: the watch may have done
        it. Then it is destroyed; over NCCL every group is aborted as well and destroyed without a device
        synchronisation (a kernel waiting on the dead peer would never let it return)."""
        if self._watch is not None:  # always, when enabled (recover's caller)
            self._watch.abort_now()
        try:
            self._leave_group(sync=not self._nccl)
        except Exception as err:  # a group already half gone: nothing of it is used again
            log.warning("elasticrun: leaving the broken group: %s", err)
            self.ctx.owns_group = False
            self.ctx.cpu_group = None

    def _leave_group(self, sync: bool = True) -> None:
        """Destroy every group of the old round (ours included), after the device's queued work (``sync``)."""
        if sync and self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)  # no NCCL kernel of the last step still runs
        dist.destroy_process_group()
        self.ctx.owns_group = False
        self.ctx.cpu_group = None

    def _join_group(self) -> None:
        """The new round's default group, then (same order as :func:`init` and the constructor on a
        newcomer) its gloo group for CPU collectives when the backend is nccl, then ours."""
        td = datetime.timedelta(seconds=self.join_timeout)
        with self.ctx.group_sockets.watch():
            dist.init_process_group(backend=self.ctx.backend, init_method="env://", timeout=td)
            self.ctx.owns_group = True
            if "nccl" in str(self.ctx.backend):
                self.ctx.cpu_group = dist.new_group(backend="gloo")
            self._new_group()

    def sync(self) -> None:
        """Broadcast the registered state from rank 0 to every rank of the current group.

        Tensors travel as CPU copies (over the gloo group); each object's ``load_state_dict`` puts
        them on its own device (a GPU tensor would otherwise be rebuilt on rank 0's device index).
        """
        payload = [None]
        if dist.get_rank() == 0:
            payload = [{"step": self.step, "extra": self.extra,
                        "objects": {k: _on_cpu(o.state_dict()) for k, o in self.objects.items()}}]
        dist.broadcast_object_list(payload, src=0, group=self._group)
        got = payload[0]
        assert got is not None
        if dist.get_rank() != 0:
            self.step = int(got["step"])
            self.extra = dict(got["extra"])
            for k, o in self.objects.items():
                o.load_state_dict(got["objects"][k])
        dist.barrier(group=self._group)  # everyone has it before anyone trains

    def _repoint_samplers(self, state: ElasticState) -> None:
        """Registered elastic samplers deal the rest of the epoch at the new rank/world."""
        for o in self.objects.values():
            if isinstance(o, ElasticDistributedSampler):
                saved = o.state_dict()
                o.num_replicas, o.rank = state.world_size, state.rank
                o.load_state_dict(saved)  # FullReshuffle: the saved world differs, the rest is dealt anew

    def _mark(self) -> None:
        """``<file>.optin`` holds the round this worker runs in: opted in, and (re-)formed for that round."""
        tmp = f"{self.path}.optin.tmp"
        with open(tmp, "w") as f:
            f.write(str(self.ctx.round))
        os.replace(tmp, self.path + ".optin")

    def _new_group(self) -> None:
        """Our gloo group, whose short ``timeout`` tells a gone peer fast. Its creation connects every
        rank within that timeout, so every rank first meets on the default group (bounded by the
        join timeout): a newcomer that builds its model and optimizer after joining the default group
        arrives late on a loaded host, and must not fail the survivors' re-form for that."""
        dist.barrier(group=self.ctx.cpu_group)
        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))

    def _arm(self) -> None:
        """The groups of the round just formed are the ones a broken round ends: their connections are cut
        (a blocked gloo call fails at once), and over NCCL their communicators are aborted as well."""
        if self._watch is not None:
            self._watch.arm(self.ctx.round, self.ctx.group_sockets.cut, abort_all_groups if self._nccl else _nothing)

    def _gate_optimizers(self) -> None:
        """NCCL: each registered optimizer's step waits for the step's collectives, and is refused when they
        were aborted (:meth:`~elasticrun.train.abort.BreakWatch.gate`)."""
        for o in self.objects.values():
            if isinstance(o, torch.optim.Optimizer):
                o.register_step_pre_hook(self._gate)

    def _gate(self, *_: Any) -> None:
        if self._watch is not None:
            self._watch.gate(self._wait_device, dist.DistBackendError)

    def _wait_device(self) -> None:
        """The work queued on this worker's current CUDA stream (the step's collectives included) has ended."""
        if self.ctx.device.type == "cuda":
            torch.cuda.current_stream(self.ctx.device).synchronize()

    def _guarded(self, fn: Any, what: str) -> None:
        try:
            fn()
        except Exception as err:  # a peer gone: gloo ends by timeout or a closed connection
            self._fail(f"{what} failed: {err}")

    def _fail(self, why: str) -> NoReturn:
        sys.stderr.write(f"elasticrun: in-place re-form failed ({why}); exiting for a restart\n")
        sys.stderr.flush()
        os._exit(EXIT_INPLACE_FAILED)  # no atexit: a half-made group must not hang the exit


def _nothing() -> None:
    """Over gloo cutting the connections ends a round's groups: no backend abort follows."""


#: Tensor types that hold one rank's shard of a larger tensor: rank 0's copy is not everyone's state.
SHARDED_TENSORS = ("DTensor", "ShardedTensor")


def _sharded_entry(value: Any, path: str = "") -> Optional[str]:
    """Where ``value`` (dicts, lists, tuples) first holds a sharded tensor: ``"path (type)"``, else None."""
    kind = type(value).__name__
    if kind in SHARDED_TENSORS:
        return f"{path or '.'} ({kind})"
    if isinstance(value, dict):
        items: Any = value.items()
    elif type(value) in (list, tuple):
        items = enumerate(value)
    else:
        return None
    for k, v in items:
        found = _sharded_entry(v, f"{path}.{k}" if path else str(k))
        if found is not None:
            return found
    return None


def _refuse_sharded(objects: Dict[str, Any]) -> None:
    """ConfigError when a registered object's state holds sharded tensors (FSDP2, DTensor): the re-form
    sends rank 0's state to every rank, which is right only for replicated state."""
    for name, obj in objects.items():
        where = _sharded_entry(obj.state_dict() if hasattr(obj, "state_dict") else None)
        if where is not None:
            raise ConfigError(f"InPlace: {name}'s state holds a sharded tensor at {where}: in-place re-forming "
                              "sends rank 0's state to every rank, so register only replicated state (DDP), "
                              "or run with --no-inplace and resume from checkpoints")


def _on_cpu(value: Any) -> Any:
    """``value`` with every tensor in its dicts, lists and tuples on the CPU (CPU tensors unchanged)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        out = copy.copy(value)  # the same type and attributes (a module state_dict's ``_metadata``)
        for k, v in value.items():
            out[k] = _on_cpu(v)
        return out
    if type(value) in (list, tuple):
        return type(value)(_on_cpu(v) for v in value)
    return value


__all__ = ["ASSIGNED", "EXIT_INPLACE_FAILED", "InPlace", "Reform", "broken_collective", "formed_round", "opted_in",
           "read_assignment", "rebuild_ddp", "write_assignment"]
