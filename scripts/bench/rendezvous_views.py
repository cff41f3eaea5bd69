"""Parts of a ``rendezvous_agents.py`` shard: the job view its agents share, and its profiler.

``--clients shared`` gives the agents of one process one etcd client and one job view
(:class:`SharedView`); each agent holds an :class:`AgentView` on it, so that only an agent that
leads sees the node records (a real follower's view has none). ``--profile DIR``: :class:`Profiler`.
"""

from __future__ import annotations

import cProfile
import marshal
import os
import pstats
import sys
import threading
import time
from typing import Any, Dict, List


class Profiler:
    """cProfile of every thread of this process (``--profile DIR``), merged and dumped per phase."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.profiles: List[cProfile.Profile] = []
        self.lock = threading.Lock()
        threading.setprofile(self._start_here)
        self._start_here()

    def _start_here(self, *_args: Any) -> None:
        sys.setprofile(None)
        prof = cProfile.Profile(time.thread_time)  # CPU time: a thread waiting costs nothing
        with self.lock:
            self.profiles.append(prof)
        prof.enable()

    def dump(self, name: str) -> None:
        merged: Dict[Any, Any] = {}
        with self.lock:
            profiles = list(self.profiles)
        for prof in profiles:
            prof.snapshot_stats()
            for func, stat in prof.stats.items():  # type: ignore[attr-defined]
                merged[func] = pstats.add_func_stats(merged[func], stat) if func in merged else stat
        path = os.path.join(self.out, f"{name}.prof")
        with open(path, "wb") as f:
            marshal.dump(merged, f)


class SharedView:
    """The job view of a ``--clients shared`` process: it mirrors the node records while one of the
    process's agents leads (the others need none: the leader's process alone receives the node
    records' watch events, as the leader's machine alone does on a real cluster)."""

    def __init__(self, view: Any) -> None:
        self.view = view
        self.leaders: set = set()
        self.lock = threading.Lock()

    def set_leading(self, agent: AgentView, on: bool) -> None:
        with self.lock:
            (self.leaders.add if on else self.leaders.discard)(agent)
            agent.leads = on
            if self.view.mirrors_nodes != bool(self.leaders):
                self.view.mirror_nodes(bool(self.leaders))


class AgentView:
    """One agent's handle on its process's :class:`SharedView`: the view's methods, but the node records
    are mirrored *for this agent* only while it leads (``mirror_nodes`` is the agent's leadership)."""

    def __init__(self, shared: SharedView) -> None:
        self._shared = shared
        self.leads = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shared.view, name)

    @property
    def mirrors_nodes(self) -> bool:
        return self.leads and self._shared.view.mirrors_nodes

    def mirror_nodes(self, on: bool) -> None:
        if on != self.leads:
            self._shared.set_leading(self, on)

    def close(self) -> None:
        """An agent that leaves does not close the view of those that stay."""
        self._shared.set_leading(self, False)
