"""examples/train.py (unchanged: this wrapper patches the names it looks up at call time) with a sample audit log,
run by the chaos soak's agents; every argument goes to the example.

Each optimizer step appends a JSON line (step, epoch, this rank's sample indices, the sampler position after them,
round, restart, rank, world) to ``$CHAOS_AUDIT_DIR/<node>-<pid>.jsonl``, one ``os.write`` on an ``O_APPEND``
descriptor; ``resume``/``reform`` lines say where a round began, ``save``/``snapshot`` (``_failed``) and
``restore_fallback`` what the tiers did. The soak steers it through files: ``$CHAOS_HANG_FILE`` (this PID: hang),
``$CHAOS_SHM_FULL_FILE`` (this node: a 1-byte memory tier) and ``$CHAOS_STOP_FILE`` (the new ``--steps``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, List, Optional

import elasticrun.checkpoint as ckpt_pkg
import elasticrun.train as et
from elasticrun.job import env as env_names

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"
NODE = os.environ.get("ELASTICRUN_NODE_ID", "")
SHM_CAP = os.environ.get(env_names.SNAPSHOT_MEMORY)


def _file_text(var: str) -> Optional[str]:
    try:
        return Path(os.environ[var]).read_text().strip()
    except (KeyError, OSError):
        return None


class Audit:
    """One worker's append-only JSON-lines log in ``directory`` (None: lines are dropped)."""

    def __init__(self, directory: Optional[str]) -> None:
        name = f"{NODE.replace('/', '_').replace('@', '_') or 'node'}-{os.getpid()}.jsonl"
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        self.fd = os.open(os.path.join(directory, name), flags, 0o644) if directory else None
        self.step = 0  # the training step of the last logged optimizer step
        self.reformed_to = -1  # the round of the last ``reform`` line

    def write(self, event: str, **fields: Any) -> None:
        if self.fd is None:
            return
        now = {key: int(os.environ.get(name, "") or default) for key, name, default in (
            ("round", env_names.ROUND, 0), ("restart", env_names.RESTART_COUNT, 0), ("rank", env_names.RANK, 0),
            ("world", env_names.WORLD_SIZE, 1))}
        record = {"ev": event, "t": time.time(), "pid": os.getpid(), "node": NODE, **now, **fields}
        os.write(self.fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())


AUDIT = Audit(os.environ.get("CHAOS_AUDIT_DIR"))


class AuditedSampler(et.ElasticDistributedSampler):
    """The example's sampler, logging the indices each step consumed (``advance`` follows ``indices``)."""

    _mine: List[int] = []
    _cursor = 0

    def indices(self) -> List[int]:
        mine = super().indices()
        self._mine, self._cursor = list(mine), 0
        return mine

    def advance(self, local_samples: int) -> int:
        taken = self._mine[self._cursor : self._cursor + local_samples]
        self._cursor += local_samples
        after = super().advance(local_samples)
        AUDIT.step += 1
        AUDIT.write("step", step=AUDIT.step, epoch=self.epoch, idx=[int(i) for i in taken], after=after)
        if _file_text("CHAOS_HANG_FILE") == str(os.getpid()):
            AUDIT.write("hang", step=AUDIT.step)
            while True:  # alive without progress: the agent's hang detection ends this
                time.sleep(3600)
        _shm_full_if_told()
        return after


class AuditedInPlace(et.InPlace):
    """Logs a ``reform`` line whenever this worker enters a round without a restart (a newcomer or kept)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.joined:
            self._logged(et.Reform.REFORMED)

    def check(self) -> et.Reform:
        return self._logged(super().check())

    def recover(self, err: BaseException) -> et.Reform:
        return self._logged(super().recover(err))

    def _logged(self, result: et.Reform) -> et.Reform:
        """Log the round entered, once (``check`` re-forms through ``recover`` after a crash)."""
        if result is et.Reform.REFORMED and self.ctx.round != AUDIT.reformed_to:
            AUDIT.step, AUDIT.reformed_to = self.step, self.ctx.round
            AUDIT.write("reform", step=self.step)
        return result


def _shm_full_if_told() -> None:
    cap = "1" if _file_text("CHAOS_SHM_FULL_FILE") == NODE else SHM_CAP
    if cap is None:
        os.environ.pop(env_names.SNAPSHOT_MEMORY, None)
    else:
        os.environ[env_names.SNAPSHOT_MEMORY] = cap


class _Fallbacks(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING and "cannot be loaded" in record.getMessage():
            AUDIT.write("restore_fallback", error=record.getMessage()[:300])


def _load_latest(*args: Any, **kwargs: Any) -> Any:
    _shm_full_if_told()
    log, handler = logging.getLogger("elasticrun.train.resume"), _Fallbacks()
    log.addHandler(handler)
    try:
        ckpt = LOAD_LATEST(*args, **kwargs)
    finally:
        log.removeHandler(handler)
    AUDIT.step = ckpt.training_state.step if (ckpt is not None and ckpt.training_state) else 0
    AUDIT.write("resume", name=getattr(ckpt, "name", None), step=AUDIT.step, tier=getattr(ckpt, "tier", None))
    return ckpt


def _audited(fn: Callable[..., Any], done: str, failed: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        step = AUDIT.step
        try:
            out = fn(*args, **kwargs)
        except BaseException as err:
            AUDIT.write(failed, step=step, error=f"{type(err).__name__}: {err}"[:300])
            raise
        AUDIT.write(done, step=step, **({"name": out} if isinstance(out, str) else {}))
        return out

    return call


class StopArgs(argparse.Namespace):
    @property
    def steps(self) -> int:
        told = _file_text("CHAOS_STOP_FILE")
        return int(told) if told and told.isdigit() else int(self.__dict__.get("_steps", 0))

    @steps.setter
    def steps(self, value: int) -> None:
        self.__dict__["_steps"] = value


LOAD_LATEST = et.load_latest


def main() -> int:
    spec = importlib.util.spec_from_file_location("elasticrun_example_train", str(EXAMPLE))
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    AUDIT.write("start")
    et.ElasticDistributedSampler = AuditedSampler  # type: ignore[misc]
    et.InPlace = AuditedInPlace  # type: ignore[misc]
    et.load_latest = _load_latest  # type: ignore[assignment]
    ckpt_pkg.save = _audited(ckpt_pkg.save, "save", "save_failed")  # type: ignore[attr-defined]
    ckpt_pkg.Snapshotter.snapshot = _audited(  # type: ignore[method-assign]
        ckpt_pkg.Snapshotter.snapshot, "snapshot", "snapshot_failed")
    parse_args = example.parse_args
    example.parse_args = lambda argv=None: StopArgs(**vars(parse_args(argv)))
    code = int(example.main(sys.argv[1:]) or 0)
    AUDIT.write("exit", code=code, step=AUDIT.step)
    return code


if __name__ == "__main__":
    sys.exit(main())
