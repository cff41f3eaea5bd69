"""The atomic commit of a save, its rollback, and the crash-injection hook used by tests.

Protocol (local filesystem): every rank writes and fsyncs its shard in
``<root>/.<name>.tmp-<token>/``; after a gather (the barrier) rank 0 fsyncs that
directory, writes ``metadata.json`` (fsynced) into it, checks the commit fence (under
elasticrun: its round is still the job's), renames it to ``<root>/<name>`` and fsyncs the
root. A crash anywhere leaves the old checkpoints untouched plus, at worst, a temporary
directory that listing reports as incomplete and loading never uses.

On fsspec storage (no atomic rename) the shards are moved into ``<root>/<name>/`` first
and ``metadata.json`` is written last, so its presence still means "complete".
"""

from __future__ import annotations

import os
import signal
import uuid

from elasticrun.checkpoint import fence
from elasticrun.checkpoint.format import METADATA_FILE
from elasticrun.checkpoint.storage import Storage, describe, retry
from elasticrun.checkpoint.temps import drop_marker
from elasticrun.errors import CheckpointError
from elasticrun.job import env as job_env
from elasticrun.job.fence import fence_identity

CRASH_ENV = job_env.CKPT_CRASH_AT
#: Phases at which ``ELASTICRUN_CKPT_CRASH_AT=<phase>[:<rank>]`` SIGKILLs the process (tests only).
PHASES = ("start", "shard-write", "after-shards", "before-metadata", "after-metadata", "after-commit")


def crash_point(phase: str, rank: int) -> None:
    """SIGKILL this process if the crash-injection variable asks for ``phase`` (on ``rank``)."""
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    want, _, only_rank = spec.partition(":")
    if want == phase and (not only_rank or int(only_rank) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def commit(storage: Storage, tmp: str, final: str, metadata: bytes, rank: int) -> None:
    """Publish ``tmp`` as ``final`` with ``metadata.json`` as the commit marker (rank 0 only).

    Right before the checkpoint becomes visible — after every byte is written and synced — calls
    the commit fence (:mod:`elasticrun.checkpoint.fence`: under elasticrun, this worker's round must
    still be current, :mod:`elasticrun.job.fence`); a newer round that opened the root meanwhile has fenced the
    temporary directory, and the rename then fails: not committed either way.
    """
    if storage.atomic_rename:
        try:
            retry(lambda: storage.sync_dir(tmp), f"fsync {storage.display(tmp)}")
            crash_point("before-metadata", rank)
            storage.write_bytes(f"{tmp}/{METADATA_FILE}", metadata)
            retry(lambda: storage.sync_dir(tmp), f"fsync {storage.display(tmp)}")
            crash_point("after-metadata", rank)
            fence.check()
            retry(lambda: storage.rename_dir(tmp, final), f"rename {storage.display(tmp)} to {storage.display(final)}")
        except CheckpointError:
            if fence_identity() is not None and not storage.exists(tmp) and not storage.exists(final):
                raise CheckpointError(
                    "a newer round took over the checkpoint root while this save was being committed (its "
                    "temporary directory was fenced): a stale round must not commit a checkpoint; not committing"
                ) from None
            raise
        retry(lambda: storage.sync_dir(storage.root), f"fsync {storage.display(storage.root)}")
        drop_marker(storage, final)
    else:
        retry(lambda: storage.mkdirs(final), f"create {storage.display(final)}")
        for fname in storage.listdir(tmp):
            retry(lambda f=fname: storage.move_file(f"{tmp}/{f}", f"{final}/{f}"), f"move {fname} into place")
        crash_point("before-metadata", rank)
        fence.check()  # no atomic rename here: metadata.json is the commit
        storage.write_bytes(f"{final}/{METADATA_FILE}", metadata)
        crash_point("after-metadata", rank)
        drop_marker(storage, final)
        try:
            storage.remove_tree(tmp)
        except Exception:  # noqa: BLE001 - an empty leftover prefix is harmless
            pass
    crash_point("after-commit", rank)


def rollback(storage: Storage, tmp: str) -> str:
    """Remove a failed save's temporary directory; returns a note for the error message."""
    try:
        storage.remove_tree(tmp)
        return "its temporary files were removed"
    except Exception as err:  # noqa: BLE001 - report, don't mask the original error
        return (f"removing its temporary directory {storage.display(tmp)} also failed ({describe(err)}); "
                "delete it by hand")
