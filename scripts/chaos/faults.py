"""The chaos soak's fault kinds and its seeded schedule."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Iterator, List, Optional


class Kind(str, Enum):
    WORKER_KILL = "worker_kill"  # SIGKILL one worker
    AGENT_KILL = "agent_kill"  # SIGKILL one agent; a new agent starts for its slot a few seconds later
    AGENT_STOP = "agent_stop"  # SIGSTOP one agent for longer than its lease, then SIGCONT
    NODE_JOIN = "node_join"  # a new node joins (when all 4 slots run: one leaves with SIGTERM instead)
    NODE_LEAVE = "node_leave"  # (only as NODE_JOIN's counterpart) SIGTERM one agent: a graceful scale-down
    ETCD_RESTART = "etcd_restart"  # SIGTERM the etcd member and start it again on the same data
    ETCD_OUTAGE = "etcd_outage"  # SIGSTOP the etcd member for 2..60 s, then SIGCONT
    DISK_FULL = "disk_full"  # fill the checkpoint filesystem until a save fails, then free it
    PARTITION = "partition"  # cut the network of the node in its own namespace, then heal it
    SHM_FULL = "shm_full"  # one node's memory tier full (cap lowered) while its worker restarts and snapshots
    MEMBER_LOSS = "member_loss"  # (3-member etcd) SIGKILL a follower member, restart it 2..6 s later
    LEADER_LOSS = "leader_loss"  # (3-member etcd) SIGKILL the leader member, restart it 2..6 s later
    HANG = "hang"  # one worker stops making progress without dying; the agents' --hang-timeout must restart
    BAD_RECORD = "bad_record"  # a malformed record written into the live job's etcd prefix (scripts/chaos/hostile.py)
    SLOW_METRICS = "slow_metrics"  # ~100 clients send half a request to one agent's --metrics-port and stall
    JOB_REUSE = "job_reuse"  # a side job ends and another with other arguments starts under its id at once


DRAWN = [k for k in Kind if k is not Kind.NODE_LEAVE]
SINGLE_MEMBER = (Kind.ETCD_RESTART, Kind.ETCD_OUTAGE)  # faults of the one-member etcd
MULTI_MEMBER = (Kind.MEMBER_LOSS, Kind.LEADER_LOSS)  # faults of --etcd-members 3


class Recovery(str, Enum):
    """What counts as recovered after a fault (measured from the fault's end)."""

    NEW_GENERATION = "a step by restarted workers"
    ANY_STEP = "a training step"
    CHECKPOINT = "a committed checkpoint"
    REUSED = "the job under the reused id succeeding"


RECOVERY = {
    Kind.WORKER_KILL: Recovery.NEW_GENERATION,
    Kind.AGENT_KILL: Recovery.NEW_GENERATION,
    Kind.AGENT_STOP: Recovery.NEW_GENERATION,
    Kind.NODE_JOIN: Recovery.NEW_GENERATION,
    Kind.NODE_LEAVE: Recovery.NEW_GENERATION,
    Kind.ETCD_RESTART: Recovery.ANY_STEP,
    Kind.ETCD_OUTAGE: Recovery.ANY_STEP,
    Kind.DISK_FULL: Recovery.CHECKPOINT,
    Kind.PARTITION: Recovery.NEW_GENERATION,
    Kind.HANG: Recovery.NEW_GENERATION,
    Kind.MEMBER_LOSS: Recovery.ANY_STEP,
    Kind.LEADER_LOSS: Recovery.ANY_STEP,
    Kind.SHM_FULL: Recovery.NEW_GENERATION,
    Kind.BAD_RECORD: Recovery.ANY_STEP,
    Kind.SLOW_METRICS: Recovery.ANY_STEP,
    Kind.JOB_REUSE: Recovery.REUSED,
}


@dataclass
class Fault:
    """One fault as drawn, then as it happened."""

    kind: Kind
    pick: float  # which target: a position in [0, 1) over the eligible targets at injection time
    duration: float  # seconds the fault lasts (outage, stop, partition, ballast) or delay (agent restart)
    gap: float  # seconds of normal training after recovery before the next fault
    t_start: float = 0.0
    t_end: float = 0.0  # when the fault was healed (recovery is measured from here)
    target: str = ""
    recovered_at: Optional[float] = None
    full_at: Optional[float] = None  # when every live node trained again in one generation
    notes: List[str] = field(default_factory=list)
    skipped: Optional[str] = None

    @property
    def recovery(self) -> Recovery:
        return RECOVERY[self.kind]

    @property
    def t_ref(self) -> float:
        """Recovery is timed from here: the fault's start when the job must re-form (the others must notice
        a lost node by themselves) or a reused id's job must run, else its end (an outage over, the disk freed)."""
        return self.t_start if self.recovery in (Recovery.NEW_GENERATION, Recovery.REUSED) else self.t_end

    @property
    def ttr(self) -> Optional[float]:
        return None if self.recovered_at is None else max(0.0, self.recovered_at - self.t_ref)

    def to_json(self) -> Dict[str, Any]:
        return {"kind": self.kind.value, "target": self.target, "start": round(self.t_start, 3),
                "healed": round(self.t_end, 3),
                "timed_from": "start" if self.t_ref == self.t_start else "end", "duration_s": round(self.duration, 2),
                "recovery": self.recovery.name.lower(), "recovered": self.recovered_at is not None,
                "time_to_recover_s": None if self.ttr is None else round(self.ttr, 2),
                "time_to_full_strength_s": None if self.full_at is None else round(self.full_at - self.t_ref, 2),
                "notes": self.notes,
                "skipped": self.skipped}


def schedule(seed: int, kinds: List[Kind], minutes: float, heartbeat: float) -> Iterator[Fault]:
    """Endless seeded faults: rounds of every enabled kind in a shuffled order.

    Durations scale with the run: an etcd outage lasts 2 s up to ``min(60, 2 * minutes)`` s (so a
    2-minute CI run keeps outages short); stops and partitions outlast the heartbeat timeout.
    """
    rng = random.Random(seed)
    max_outage = max(2.0, min(60.0, 2.0 * minutes))
    gap_hi = 2.0 if minutes <= 3 else 8.0
    while True:
        order = list(kinds)
        rng.shuffle(order)
        for kind in order:
            if kind is Kind.ETCD_OUTAGE:
                duration = rng.uniform(2.0, max_outage)
            elif kind in (Kind.AGENT_STOP, Kind.PARTITION):
                duration = heartbeat + rng.uniform(2.0, 6.0)
            elif kind in (Kind.AGENT_KILL, Kind.MEMBER_LOSS, Kind.LEADER_LOSS):
                duration = rng.uniform(0.5, 4.0) if kind is Kind.AGENT_KILL else rng.uniform(2.0, 6.0)
            elif kind in (Kind.DISK_FULL, Kind.SHM_FULL):
                duration = 15.0  # at most this long, or until a save failed
            elif kind is Kind.BAD_RECORD:
                duration = rng.uniform(3.0, 6.0)  # the record stays this long (every agent's loop reads it)
            elif kind is Kind.SLOW_METRICS:
                duration = rng.uniform(4.0, 10.0)  # the stalled clients hold their connections this long
            else:
                duration = 0.0
            yield Fault(kind, rng.random(), duration, rng.uniform(1.0, gap_hi))
