"""The commit fence as the writer sees it: one check, called right before a save becomes visible.

Under elasticrun a worker of a stale round must not commit (the rule: :mod:`elasticrun.job.fence`).
Checking that needs etcd, which this package does not reach: the check is installed from above —
importing :mod:`elasticrun.train` installs the etcd read (:mod:`elasticrun.train.fence`) — and
:func:`check` calls it. A worker under elasticrun with etcd that has no fence installed cannot
confirm its round and refuses to commit; outside elasticrun there is nothing to check.
"""

from __future__ import annotations

from typing import Callable, Optional

from elasticrun.errors import CheckpointError
from elasticrun.job.fence import fenced_round

#: A commit fence: returns when the save may become visible, raises CheckpointError when it must not.
CommitFence = Callable[[], None]

_installed: Optional[CommitFence] = None


def install(fence: Optional[CommitFence]) -> Optional[CommitFence]:
    """Make ``fence`` this process's commit fence (None: none); returns the one it replaces."""
    global _installed
    previous, _installed = _installed, fence
    return previous


def check() -> None:
    """Raise CheckpointError unless this process may publish a save now (see the module's text)."""
    if _installed is not None:
        _installed()
        return
    mine = fenced_round()
    if mine is not None:
        raise CheckpointError(
            f"cannot confirm that round {mine} is still current (no commit fence in this process: import "
            "elasticrun.train, which installs it); not committing"
        )


__all__ = ["CommitFence", "check", "install"]
