"""Why a running round ends, and when the leader ends it: decided. Pure: no I/O, no clock.

Every agent asks at each turn of its round loop whether its round is over (:func:`round_end`): the
job ended, a newer round was formed, a worker failed (``rounds/<n>/failed``), the round was ended
(``rounds/<n>/end``), or every member finished (success). The leader, the one agent that sees the
node records (:mod:`elasticrun.rendezvous.leader`), also ends the round for everyone: when a
member's record vanished or changed its lease (:class:`LoseMember`), and for newcomers once they
waited a stability window (:func:`plan_scale_up`). The round watch
(:mod:`elasticrun.rendezvous.watch`) gathers the snapshots and writes what these decide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple, Union

from elasticrun.rendezvous.records import NodeInfo, Topology
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.rendezvous.states import RoundOutcome

Record = Mapping[str, Any]
Nodes = Mapping[str, Tuple[NodeInfo, int]]


@dataclass(frozen=True)
class RunningRound:
    """What :func:`round_end` needs about round ``topo``, as the agent's view has it."""

    topo: Topology  # the round this agent runs
    current: Optional[Topology]  # the job's round now
    state: Optional[Record] = None  # the job's end
    failed: Optional[Record] = None  # the round's failure flag
    end: Optional[Record] = None  # the round's end record
    done: int = 0  # members that reported their workers finished
    # The leader's node records, when a record appeared, vanished or changed its lease since its last
    # complete check (None: nothing to check, or not the leader).
    nodes: Optional[Nodes] = None
    unreachable: bool = False  # etcd failed to answer us lately: a missing member may still come back


@dataclass(frozen=True)
class Ended:
    """The round is over: ``reason`` says why (RoundOutcome.SUCCEEDED: every member finished)."""

    reason: Union[str, RoundOutcome]


@dataclass(frozen=True)
class LoseMember:
    """The leader ends the round for everyone (``rounds/<n>/end``): member ``node_id`` is gone."""

    node_id: str

    @property
    def reason(self) -> str:
        return f"node {self.node_id} left or lost its lease"


@dataclass(frozen=True)
class Runs:
    """The round runs on; ``checked``: the leader's membership check is complete (no need to look at the
    node records again until they change)."""

    checked: bool = False


def round_end(snap: RunningRound) -> Union[Ended, LoseMember, Runs]:
    """Whether round ``snap.topo`` is over, or the leader must end it."""
    if snap.state:
        return Ended(f"job {snap.state.get('state')}")
    if snap.current is None or snap.current.round != snap.topo.round:
        return Ended("a newer round was formed")
    if snap.failed is not None:
        return Ended(f"worker failure on {snap.failed.get('node', '?')}")
    if snap.end is not None:
        return Ended(str(snap.end.get("reason", "round ended")))
    checked = False
    if snap.nodes is not None:
        checked = True
        for m in snap.current.members:  # the same round; a member may have rejoined after an outage (new lease)
            entry = snap.nodes.get(m.node_id)
            if entry is None or entry[1] != m.lease:
                if snap.unreachable:  # after an etcd outage every lease may have expired: let members rejoin
                    checked = False  # look again: the member may still come back
                    continue
                return LoseMember(m.node_id)
    if snap.done >= len(snap.topo.members):
        return Ended(RoundOutcome.SUCCEEDED)
    return Runs(checked)


@dataclass(frozen=True)
class ScaleUp:
    """The leader's decision about newcomers while round n runs."""

    since: Optional[float]  # when the stability window opened (None: no newcomer)
    announce: Tuple[str, ...] = ()  # newcomers first seen now: say so and write ``rounds/<n>/joining``
    end_reason: str = ""  # end the round for the newcomers that are ready (``rounds/<n>/end``)
    due: Optional[float] = None  # seconds until the window closes (to wake up in time)


def plan_scale_up(topo: Topology, nodes: Optional[Nodes], any_done: bool, since: Optional[float],
                  s: RendezvousSettings, now: float) -> ScaleUp:
    """End round ``topo`` for newcomers once they waited a stability window (below ``max_nodes`` only).

    ``nodes``: the leader's node records (None: not the leader, or no more nodes than members);
    ``any_done``: a member's workers finished (the job is ending: no scale-up); ``since``: when the
    window opened; ``now``: the monotonic clock. The window opens when a newcomer registers (so it
    overlaps the newcomer's own start-up); the round ends once it has closed and at least one newcomer
    is ready (waits for a round).
    """
    if nodes is None or len(topo.members) >= s.max_nodes or any_done:
        return ScaleUp(None)
    members = {m.node_id for m in topo.members}
    newcomers = {n: info for n, (info, _) in nodes.items() if n not in members}
    if not newcomers:
        return ScaleUp(None)
    announce: Tuple[str, ...] = ()
    if since is None:
        since, announce = now, tuple(sorted(newcomers))
    ready = sorted(n for n, info in newcomers.items() if info.waiting_for > topo.round)
    if now - since >= s.stability_window and ready:
        return ScaleUp(since, announce, f"scale-up: {len(ready)} node(s) joined ({', '.join(ready)})")
    left = s.stability_window - (now - since)
    return ScaleUp(since, announce, due=left if left > 0 else None)  # closed: a newcomer's "ready" wakes us


__all__ = ["Ended", "LoseMember", "Runs", "RunningRound", "ScaleUp", "plan_scale_up", "round_end"]
