"""The etcd key layout of one job: everything lives under ``/elasticrun/<job_id>/``.

This module is the only place that builds an etcd key. A job's etcd user needs read and
write access to its own prefix only (see docs/security.md)::

    config                      job settings, created once (create-if-absent)
    state                       terminal state: {"state": "succeeded"|"failed"|"stopped", ...}
    nodes/<node-id>             NodeInfo, attached to the node's lease
    node-ranks/<r>              node id of the node started with --node-rank r (on its lease)
    topology                    the current round (Topology), written by compare-and-swap;
                                also the commit fence: a worker commits a checkpoint only
                                while its round is still the one in here
    leader                      node id of the agent that watches every node record and forms
                                rounds (on its lease; the others watch the job without nodes/)
    rounds/<n>/joining          the leader saw a newcomer: round n ends after the stability window
    rounds/<n>/failed           first worker failure of round n (ends the round, counts a restart)
    rounds/<n>/failures/<node>  that node's failed workers (root cause)
    rounds/<n>/end              round n ended for a membership change (scale-up)
    rounds/<n>/done/<node>      all of that node's workers exited 0
    events/<n>                  RescaleEvent that formed round n (the newest 50 rounds are kept,
                                with their rounds/<n>/ keys: older ones are range-deleted)
    control/checkpoint/<id>     a checkpoint request (``elasticrun ckpt save --rdzv-id``)
    control/checkpoint-done/<id> rank 0's answer to it (on a lease; the request is deleted when
                                answered, the answer once read)
    progress/<node-id>          last step/loss reported by workers (on a short lease)
    goodput/<node-id>           that agent's goodput accounting (on its lease, every ~10 s; the
                                final one, written when the job ended, without a lease)
    health/stragglers           the leader's straggler scores of the current round (and the node it
                                drains, with --straggler-action drain); no lease
    health/excluded/<node-id>   a node kept out of the job: it failed its --node-check or was drained
                                as a straggler (reason, time); no lease, removed when it joins again
    etcd/members/<node-id>      the member of the job's own etcd that node runs (hosted etcd only;
                                launch/etcdmembers.py)
    etcd/assign/<node-id>       the leader asks that node to start a member (removed once it did)
    etcd/endpoints              the client endpoints of the job's etcd members: every agent talks
                                through them and hands them to its workers
    expiry                      once the job ended: the lease its keys were put on, so that they
                                expire (``--ended-job-ttl``); on that lease itself
    ping                        never written: connect() reads it to prove access
"""

from __future__ import annotations

from dataclasses import dataclass

#: Every job's keys live under ``ROOT + job_id + "/"``.
ROOT = "/elasticrun/"


@dataclass(frozen=True)
class JobKeys:
    """Key names for one job (``job_id`` as given to ``--rdzv-id``)."""

    job_id: str

    @property
    def job(self) -> str:
        """Old name of :attr:`job_id` (kept for callers not yet renamed)."""
        return self.job_id

    @property
    def prefix(self) -> str:
        return f"{ROOT}{self.job_id}/"

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
    def fence(self) -> str:
        """The key whose ``round`` a committing worker must match (the topology)."""
        return self.topology

    @property
    def ping(self) -> str:
        """A key inside the job's prefix that connect() reads to prove it may (never written)."""
        return self.prefix + "ping"

    @property
    def nodes(self) -> str:
        return self.prefix + "nodes/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    def node_rank(self, rank: int) -> str:
        """Claimed by the node started with ``--node-rank rank`` (under its lease): one node per rank."""
        return f"{self.prefix}node-ranks/{rank}"

    @property
    def rounds(self) -> str:
        """Prefix of every round's keys (``rounds/<n>/`` sorts by ``n``: zero-padded)."""
        return self.prefix + "rounds/"

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

    def joining(self, n: int) -> str:
        """Written by the leader when a newcomer opens round n's stability window (standbys warm up)."""
        return self.round(n) + "joining"

    @property
    def leader(self) -> str:
        """Held (create-if-absent, on its lease) by the agent that mirrors every node record."""
        return self.prefix + "leader"

    def dones(self, n: int) -> str:
        return self.round(n) + "done/"

    def done(self, n: int, node_id: str) -> str:
        return self.dones(n) + node_id

    def readies(self, n: int) -> str:
        """In-place re-forming: newcomers of round n whose workers are ready to join (``ready/<node>``)."""
        return self.round(n) + "ready/"

    def ready(self, n: int, node_id: str) -> str:
        return self.readies(n) + node_id

    def lefts(self, n: int) -> str:
        """Nodes that left round n gracefully (written before their lease is revoked): ``left/<node>``."""
        return self.round(n) + "left/"

    def left(self, n: int, node_id: str) -> str:
        return self.lefts(n) + node_id

    @property
    def events(self) -> str:
        return self.prefix + "events/"

    def event(self, n: int) -> str:
        return f"{self.events}{n:08d}"

    @property
    def control(self) -> str:
        return self.prefix + "control/"

    @property
    def checkpoint_requests(self) -> str:
        """Prefix of the pending checkpoint requests (one key per request id)."""
        return self.control + "checkpoint/"

    def checkpoint_request(self, request_id: str) -> str:
        return self.checkpoint_requests + request_id

    @property
    def checkpoint_answers(self) -> str:
        """Prefix of rank 0's answers to checkpoint requests."""
        return self.control + "checkpoint-done/"

    def checkpoint_answer(self, request_id: str) -> str:
        return self.checkpoint_answers + request_id

    @property
    def progress(self) -> str:
        return self.prefix + "progress/"

    def progress_of(self, node_id: str) -> str:
        return self.progress + node_id

    @property
    def goodput(self) -> str:
        return self.prefix + "goodput/"

    def goodput_of(self, node_id: str) -> str:
        """The node's goodput accounting (elasticrun.launch.goodput), on the agent's lease."""
        return self.goodput + node_id

    @property
    def stragglers(self) -> str:
        """The leader's straggler scores (elasticrun.launch.stragglers), no lease."""
        return self.prefix + "health/stragglers"

    @property
    def excluded(self) -> str:
        return self.prefix + "health/excluded/"

    def excluded_of(self, node_id: str) -> str:
        """Why ``node_id`` stays out of the job (a failed node check, a drain)."""
        return self.excluded + node_id

    @property
    def etcd(self) -> str:
        """Prefix of the records of the job's own etcd (its members, requests, endpoints)."""
        return self.prefix + "etcd/"

    @property
    def etcd_members(self) -> str:
        """Prefix of the records of the members of a job's own etcd, one per node that runs one."""
        return self.etcd + "members/"

    def etcd_member(self, node_id: str) -> str:
        return self.etcd_members + node_id

    @property
    def etcd_assignments(self) -> str:
        """Prefix of the leader's requests that a node start a member of the job's etcd."""
        return self.etcd + "assign/"

    def etcd_assignment(self, node_id: str) -> str:
        return self.etcd_assignments + node_id

    @property
    def etcd_endpoints(self) -> str:
        """The client endpoints of the job's etcd members (written by the leader when they change)."""
        return self.etcd + "endpoints"

    @property
    def expiry(self) -> str:
        """Written once the job ended: the lease every key of the job was put on (``--ended-job-ttl``)."""
        return self.prefix + "expiry"

    @property
    def restarts(self) -> str:
        """Times of the job's recent restarts (``--restart-window``), written with the round."""
        return self.prefix + "restarts"


def job_of(key: str) -> str:
    """The job id of a key under :data:`ROOT` ('' if none)."""
    if not key.startswith(ROOT):
        return ""
    return key[len(ROOT):].split("/", 1)[0]


def last_part(key: str) -> str:
    """The last path element of a key (a node id, a request id)."""
    return key.rsplit("/", 1)[-1]


__all__ = ["ROOT", "JobKeys", "job_of", "last_part"]
