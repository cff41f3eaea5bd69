"""The round watch: one agent's eye on the round it runs, through its job view.

At each turn of the agent's round loop the watch gathers what the decisions of
:mod:`elasticrun.rendezvous.roundend` need from the view, and writes what they decide: whether the
round is over (:meth:`RoundWatch.round_change`) and, on the leader, whether newcomers end it
(:meth:`RoundWatch.maybe_scale_up`). Only the leader (:mod:`elasticrun.rendezvous.leader`) sees the
node records, so it is the one that ends a round for a lost member or for newcomers; the others
learn it from ``rounds/<n>/end``.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Tuple, Union

from elasticrun.job import records
from elasticrun.job.keys import JobKeys
from elasticrun.rendezvous.leader import Leadership
from elasticrun.rendezvous.records import Topology
from elasticrun.rendezvous.roundend import Ended, LoseMember, RunningRound, plan_scale_up, round_end
from elasticrun.rendezvous.settings import RendezvousSettings
from elasticrun.rendezvous.states import RoundOutcome
from elasticrun.rendezvous.view import JobView
from elasticrun.rendezvous.writer import RoundWriter


class RoundWatch:
    """Why one agent's round ends, and the leader's duty to end it (see the module doc).

    ``leading`` claims the leader key when nobody holds it (True while this agent leads);
    ``unreachable`` says whether etcd failed to answer this agent lately (then a missing member may
    still rejoin, and the round is not ended for it).
    """

    def __init__(self, view: JobView, keys: JobKeys, settings: RendezvousSettings, writer: RoundWriter,
                 leadership: Leadership, node_id: str, say: Callable[[str], None],
                 leading: Callable[[], bool], unreachable: Callable[[], bool]) -> None:
        self.view = view
        self.keys = keys
        self.settings = settings
        self.writer = writer
        self.leadership = leadership
        self.node_id = node_id
        self._say = say
        self._leading = leading
        self._unreachable = unreachable
        self._quiet_since: Optional[Tuple[int, int]] = None  # (round, view.job_version) last found running
        self._members_checked: Optional[Tuple[int, int]] = None  # (round, view.members_version) checked
        self._newcomers_since: Optional[float] = None  # when the leader first saw a newcomer (monotonic)

    def view_version(self) -> int:
        """The view's version that :meth:`wait_view` waits on (see there)."""
        return self.view.version if self.leadership.leads else self.view.job_version

    def wait_view(self, since: int, timeout: float) -> int:
        """Wait for a change of the view that matters to us (or ``timeout``); the new :meth:`view_version`.

        The leader wakes on every change; the others not on node records alone (which a view shared
        by several agents, as in the bench, would otherwise deliver to each of them).
        """
        return self.view.wait_change(since, timeout, nodes=self.leadership.leads)

    def round_change(self, topo: Topology) -> Union[str, RoundOutcome, None]:
        """Why round ``topo`` is over (None while it runs); RoundOutcome.SUCCEEDED when every member finished.
        The leader ends the round for a lost member here (``rounds/<n>/end``)."""
        # A node that does not lead learns everything from the job's keys: while they did not change
        # since we last found the round running, it still runs (no lookups at each turn of our loop).
        quiet = (topo.round, self.view.job_version)
        if quiet == self._quiet_since and not self.leadership.leads:
            return None
        snap = self._running(topo)
        decided = round_end(snap)
        if isinstance(decided, LoseMember):
            self.writer.end_round(topo.round, decided.reason, self.node_id, lost=decided.node_id)
        if isinstance(decided, (LoseMember, Ended)):
            self._quiet_since = None
            return decided.reason
        if snap.nodes is not None:
            self._members_checked = (topo.round, self.view.members_version) if decided.checked else None
        self._quiet_since = quiet
        return None

    def _running(self, topo: Topology) -> RunningRound:
        """The snapshot :func:`round_end` decides on. The leader looks at the node records only when one
        appeared, vanished or changed its lease since its last complete check (not for each Active report)."""
        view, keys = self.view, self.keys
        current, _ = view.topology()
        state = view.state()
        failed = view.record(keys.failed(topo.round), records.failed_flag)
        end = view.record(keys.end(topo.round), records.end_flag)
        nodes = None
        if (not state and current is not None and current.round == topo.round and failed is None and end is None
                and self._leading() and self._members_checked != (topo.round, view.members_version)):
            nodes = view.nodes()
        return RunningRound(topo, current, state, failed, end, done=len(view.under(keys.dones(topo.round))),
                            nodes=nodes, unreachable=nodes is not None and self._unreachable())

    def scale_up_pending(self, topo: Topology) -> bool:
        """True once the leader saw a newcomer: round ``topo`` ends within a stability window."""
        return self._newcomers_since is not None or self.view.get(self.keys.joining(topo.round)) is not None

    def maybe_scale_up(self, topo: Topology) -> Optional[float]:
        """The leader ends the round for newcomers once they waited a stability window (below max only).

        Returns the seconds until the window closes (to wake up in time), or None.
        """
        view = self.view
        # Newcomers can only be there when more nodes are registered than the round has members (and only
        # the leader sees them); a full round takes none (spares wait).
        size = len(topo.members)
        wanted = view.mirrors_nodes and size < view.node_count() and size < self.settings.max_nodes
        nodes = view.nodes() if wanted else None
        any_done = nodes is not None and bool(view.under(self.keys.dones(topo.round)))
        decided = plan_scale_up(topo, nodes, any_done, self._newcomers_since, self.settings, time.monotonic())
        self._newcomers_since = decided.since
        if decided.announce:
            self._say(f"{len(decided.announce)} node(s) joining; scaling up in {self.settings.stability_window:.1f}s")
            self.writer.joining(topo.round, list(decided.announce))
        if decided.end_reason:
            self.writer.end_round(topo.round, decided.end_reason, self.node_id)
        return decided.due
