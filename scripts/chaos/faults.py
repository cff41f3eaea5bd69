"""What a chaos fault is: ``FaultKind`` (one class per kind, registered in ``kinds.KINDS``), ``Fault`` (one
occurrence, as drawn and then as it happened) and ``schedule`` (the seeded or given order)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple

if TYPE_CHECKING:
    from .env import Machine
    from .soak import Soak


class Recovery(str, Enum):
    """What counts as recovered after a fault."""

    NEW_ROUND = "a step in a round formed after the fault"
    ANY_STEP = "a training step"
    CHECKPOINT = "a committed checkpoint"
    REUSED = "the job under the reused id succeeding"


class How(str, Enum):
    """How the job recovered from a fault: the rounds formed until the next fault, from the agents' events."""

    IN_PLACE = "in_place"  # every round formed kept the other nodes' workers
    RESTART = "restart"  # a round restarted every worker
    NONE = "none"  # no round was formed: the job trained on


class FaultKind:
    """One kind of fault: its name, what its recovery is, how long it lasts, what the machine needs for it
    (``prepare``), how it is done (``inject``) and the invariants of its own (``check``)."""

    name: ClassVar[str]
    recovery: ClassVar[Recovery] = Recovery.NEW_ROUND
    etcd_members: ClassVar[int] = 0  # 1 or 3: only with that many etcd members; 0: with either
    drawn: ClassVar[bool] = True  # False: never scheduled itself (node_leave is node_join's counterpart)

    span: ClassVar[Tuple[float, float]] = (0.0, 0.0)  # seconds it lasts, drawn uniformly (equal bounds: fixed)
    beyond_heartbeat: ClassVar[bool] = False  # the span comes on top of the agents' heartbeat timeout

    def duration(self, rng: random.Random, minutes: float, heartbeat: float) -> float:
        """Seconds the fault lasts (an outage, a stop, a ballast) or delays (an agent's restart)."""
        lo, hi = self.span
        return (heartbeat if self.beyond_heartbeat else 0.0) + (rng.uniform(lo, hi) if hi > lo else lo)

    def prepare(self, machine: Machine) -> Optional[str]:
        """Set the machine up for this kind before the job starts; why it cannot run here, or None."""
        return None

    def inject(self, soak: Soak, fault: Fault) -> None:
        """Do the fault and heal it; set ``fault.target`` (what was hit), or ``fault.skipped`` (why nothing)."""
        raise NotImplementedError

    def check(self, soak: Soak, fault: Fault) -> None:
        """After the recovery wait: this kind's own invariants (appended to ``soak.violations``)."""


@dataclass
class Fault:
    """One fault as drawn, then as it happened."""

    kind: FaultKind
    pick: float  # which target: a position in [0, 1) over the eligible targets at injection time
    duration: float
    gap: float  # seconds of normal training after recovery before the next fault
    t_start: float = 0.0
    t_end: float = 0.0  # when the fault was healed
    target: str = ""
    recovered_at: Optional[float] = None
    full_at: Optional[float] = None  # when every live node trained again in one generation
    notes: List[str] = field(default_factory=list)
    skipped: Optional[str] = None
    noted: Dict[str, Any] = field(default_factory=dict)  # what ``inject`` noted for ``check``
    how: How = How.NONE

    def choose(self, items: Sequence[Any]) -> Any:
        """The item of ``items`` that ``pick`` points at."""
        return items[int(self.pick * len(items)) % len(items)]

    @property
    def t_ref(self) -> float:
        """Recovery is timed from the fault's start when the job must re-form (the others must notice a lost
        node by themselves) or a reused id's job must run, else from its end (an outage over, the disk freed)."""
        return self.t_start if self.kind.recovery in (Recovery.NEW_ROUND, Recovery.REUSED) else self.t_end

    @property
    def ttr(self) -> Optional[float]:
        return None if self.recovered_at is None else max(0.0, self.recovered_at - self.t_ref)

    def to_json(self) -> Dict[str, Any]:
        return {"kind": self.kind.name, "target": self.target, "start": round(self.t_start, 3),
                "healed": round(self.t_end, 3), "timed_from": "start" if self.t_ref == self.t_start else "end",
                "duration_s": round(self.duration, 2), "recovery": self.kind.recovery.name.lower(),
                "recovered": self.recovered_at is not None, "recovered_how": self.how.value,
                "time_to_recover_s": None if self.ttr is None else round(self.ttr, 2),
                "time_to_full_strength_s": None if self.full_at is None else round(self.full_at - self.t_ref, 2),
                "notes": self.notes, "skipped": self.skipped}


def schedule(seed: int, kinds: Sequence[FaultKind], minutes: float, heartbeat: float,
             shuffle: bool = True) -> Iterator[Fault]:
    """Endless faults: rounds of ``kinds``, each round shuffled by ``random.Random(seed)`` (or in the order
    given); durations, targets and gaps come from the same generator. Gaps are 1-2 s in runs of up to 3
    minutes, 1-8 s in longer ones."""
    rng = random.Random(seed)
    gap_hi = 2.0 if minutes <= 3 else 8.0
    while True:
        order = list(kinds)
        if shuffle:
            rng.shuffle(order)
        for kind in order:
            duration = kind.duration(rng, minutes, heartbeat)
            yield Fault(kind, rng.random(), duration, rng.uniform(1.0, gap_hi))
