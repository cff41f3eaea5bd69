"""The etcd key layout of one job: everything lives under ``/elasticrun/<rdzv-id>/``.

    config                      job settings, created once (create-if-absent)
    state                       terminal state: {"state": "succeeded"|"failed", ...}
    nodes/<node-id>             NodeInfo, attached to the node's lease
    topology                    the current round (Topology), written by compare-and-swap
    rounds/<n>/failed           first worker failure of round n (ends the round, counts a restart)
    rounds/<n>/failures/<node>  that node's failed workers (root cause)
    rounds/<n>/end              round n ended for a membership change (scale-up)
    rounds/<n>/done/<node>      all of that node's workers exited 0
    events/<n>                  RescaleEvent that formed round n (bounded history)
    control/...                 requests to the running job (e.g. checkpoint now)
    progress/<node-id>          last step/loss reported by workers
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT = "/elasticrun/"


@dataclass(frozen=True)
class JobKeys:
    """Key names for one job."""

    job: str

    @property
    def prefix(self) -> str:
        return f"{ROOT}{self.job}/"

    @property
    def config(self) -> str:
        return self.prefix + "config"

    @property
    def state(self) -> str:
        return self.prefix + "state"

    @property
    def topology(self) -> str:
        return self.prefix + "topology"

    @property
    def nodes(self) -> str:
        return self.prefix + "nodes/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def round(self, n: int) -> str:
        return f"{self.prefix}rounds/{n:08d}/"

    def failed(self, n: int) -> str:
        return self.round(n) + "failed"

    def failures(self, n: int) -> str:
        return self.round(n) + "failures/"

    def failure(self, n: int, node_id: str) -> str:
        return self.failures(n) + node_id

    def end(self, n: int) -> str:
        return self.round(n) + "end"

    def dones(self, n: int) -> str:
        return self.round(n) + "done/"

    def done(self, n: int, node_id: str) -> str:
        return self.dones(n) + node_id

    @property
    def events(self) -> str:
        return self.prefix + "events/"

    def event(self, n: int) -> str:
        return f"{self.events}{n:08d}"

    @property
    def control(self) -> str:
        return self.prefix + "control/"

    @property
    def progress(self) -> str:
        return self.prefix + "progress/"


def job_of(key: str) -> str:
    """The job id of a key under :data:`ROOT` ('' if none)."""
    if not key.startswith(ROOT):
        return ""
    return key[len(ROOT):].split("/", 1)[0]
