"""``--node-check``: the node's pre-flight before it joins, and the record of a node kept out of the job.

A node that fails its check (or is drained as a straggler, :mod:`elasticrun.launch.stragglers`) writes
``health/excluded/<node-id>`` (reason, checks, time; no lease, so ``elasticrun status`` shows it after the
agent exited) and exits 6 (``ExitCode.NODE_UNHEALTHY``): it never registers, so it is never in a round and
costs the job no restart. A node that joins removes its own record.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional

from elasticrun.errors import ElasticrunError
from elasticrun.health.node import CheckPlan, NodeReport, run_check
from elasticrun.job import env as env_names
from elasticrun.job.exitcodes import ExitCode
from elasticrun.job.keys import JobKeys
from elasticrun.launch.config import LaunchConfig, RdzvBackend
from elasticrun.store.client import EtcdStore


class NodeExcluded(ElasticrunError):
    """This node stays out of the job: it failed its node check, or was drained as a straggler."""

    exit_code = int(ExitCode.NODE_UNHEALTHY)


def exclude(store: EtcdStore, job_id: str, node_id: str, reason: str, why: str,
            checks: Optional[List[Dict[str, Any]]] = None) -> None:
    """Record (best effort) that ``node_id`` stays out of the job, and why."""
    try:
        store.put_json(JobKeys(job_id).excluded_of(node_id),
                       {"reason": reason, "why": why, "time": time.time(), "checks": checks or []})
    except ElasticrunError:
        pass  # etcd trouble: the log and the exit code still say it


def readmit(store: EtcdStore, job_id: str, node_id: str) -> None:
    """Remove our exclusion record, if any (best effort): we join the job now."""
    try:
        store.delete(JobKeys(job_id).excluded_of(node_id))
    except ElasticrunError:
        pass


def check_plan(cfg: LaunchConfig, store: EtcdStore) -> CheckPlan:
    """What ``--node-check`` checks: the checkpoint directory of ``$ELASTICRUN_CHECKPOINT_DIR`` (else the
    working directory), /dev/shm, the job's etcd when it runs outside the job, the GPUs when there are any."""
    r = cfg.rendezvous
    external = r.rdzv_backend not in (RdzvBackend.C10D, RdzvBackend.STATIC) and not r.standalone
    ping = JobKeys(cfg.rendezvous.rdzv_id).ping
    return CheckPlan(ckpt_dir=os.environ.get(env_names.CHECKPOINT_DIR) or os.getcwd(),
                     endpoint=cfg.rendezvous.rdzv_endpoint if external else "",
                     etcd_read=(lambda: store.get(ping)) if external else None,
                     thresholds=cfg.health.node_check_thresholds, gpu=True, allreduce=True)


def admit(cfg: LaunchConfig, store: EtcdStore, say: Callable[[str], None],
          on_result: Callable[[NodeReport], None]) -> Optional[NodeReport]:
    """Run ``--node-check`` (when on) before the node joins; NodeExcluded when it fails. Without the flag,
    or when it passes, the node's old exclusion record (a drain, an earlier failed check) is removed."""
    report: Optional[NodeReport] = None
    if cfg.health.node_check:
        say("checking this node before it joins (--node-check)")
        t0 = time.monotonic()
        report = run_check(check_plan(cfg, store))
        on_result(report)
        if not report.passed:
            for c in report.checks:
                if c.failed:
                    say(f"node check failed: {c.name}: {c.detail} (threshold {c.threshold} {c.unit})")
            exclude(store, cfg.rendezvous.rdzv_id, cfg.rendezvous.node_id, report.reason, "node-check",
                    [c.to_dict() for c in report.checks if c.failed])
            raise NodeExcluded(f"this node failed its check and stays out of job {cfg.rendezvous.rdzv_id!r}: "
                               f"{report.reason}")
        say(f"node check passed ({len(report.checks)} checks in {time.monotonic() - t0:.1f} s)")
    readmit(store, cfg.rendezvous.rdzv_id, cfg.rendezvous.node_id)
    return report


__all__ = ["NodeExcluded", "admit", "check_plan", "exclude", "readmit"]
