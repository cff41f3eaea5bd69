"""The exit codes of ``elasticrun``: what a scheduler (Kubernetes, Kubeflow, Slurm) may act on.

One table, shared by every process: docs/deploy.md gives what a scheduler does with each code,
docs/cli.md which command exits with which code and when (tests/test_cli_exit_codes.py checks it).
Transient failures exit with a code that Kubeflow's ``ExitCode`` restart policy retries (130,
137, 138, 143); failures that a retry cannot fix exit 1 (the script) or 2 (the command line,
settings, credentials).

- 143 (128 + SIGTERM): the agent was told to stop (SIGTERM, SIGHUP, SIGQUIT or any signal of
  ``--signals-to-handle``) and drained: its workers had ``--shutdown-timeout`` to save. This is
  what a preempted pod or a Slurm job at its ``--signal`` notice returns.
- 130 (128 + SIGINT): Ctrl-C, drained the same way (the shell's convention, retryable too).
- 138: a transient failure elasticrun itself detected: etcd unreachable at the start or lost
  beyond ``--etcd-outage-grace``, the rendezvous timed out while nodes may still come. 138 is in
  Kubeflow's retryable set and no common kill produces it (137 is SIGKILL / the OOM killer,
  143 SIGTERM), so an operator can tell "elasticrun asks for a retry" from a kill.
"""

from __future__ import annotations

import enum
import signal

from elasticrun.errors import (
    CheckpointError,
    ElasticrunError,
    JobFailedError,
    RendezvousError,
    StoreError,
    StoreSetupError,
)


class ExitCode(enum.IntEnum):
    """Exit status of an ``elasticrun`` process (the agent and the CLI's sub-commands)."""

    SUCCEEDED = 0
    JOB_FAILED = 1  # workers failed and the restart budget is used up: the script's fault, permanent
    #                 (`status --watch`: the job failed; `elasticrun etcd`: etcd would not run)
    USAGE = 2  # bad flags, settings, credentials or certificates: permanent until someone fixes them
    CHECKPOINT = 5  # `elasticrun ckpt ...`: a checkpoint could not be found, read or verified
    NODE_UNHEALTHY = 6  # `elasticrun check` failed; `run --node-check`: the node failed it, or was drained
    #                     as a straggler: the node needs attention, a retry on it would not help
    INTERRUPTED = 130  # SIGINT (Ctrl-C): workers drained; retryable
    TRANSIENT = 138  # etcd unreachable/lost, rendezvous timed out: try again later; retryable
    DRAINED = 143  # SIGTERM (preemption) or another handled signal: workers drained; retryable

    @property
    def retryable(self) -> bool:
        """Whether a scheduler should start the node again (Kubeflow's ``ExitCode`` policy does)."""
        return self in RETRYABLE


RETRYABLE = frozenset({ExitCode.INTERRUPTED, ExitCode.TRANSIENT, ExitCode.DRAINED})


def for_signal(signum: int) -> ExitCode:
    """The exit code of an agent that drained after ``signum``: 130 for SIGINT, 143 for the others."""
    return ExitCode.INTERRUPTED if signum == signal.SIGINT else ExitCode.DRAINED


def for_error(err: ElasticrunError) -> int:
    """The exit code of a run that ends with ``err`` (its ``exit_code`` when it sets one)."""
    if err.exit_code is not None:
        return int(err.exit_code)
    if isinstance(err, JobFailedError):
        return ExitCode.JOB_FAILED
    if isinstance(err, StoreSetupError):
        return ExitCode.USAGE
    if isinstance(err, (StoreError, RendezvousError)):
        return ExitCode.TRANSIENT
    if isinstance(err, CheckpointError):
        return ExitCode.CHECKPOINT
    return ExitCode.USAGE


__all__ = ["RETRYABLE", "ExitCode", "for_error", "for_signal"]
