"""The soak's 3-member etcd mode (``--etcd-members 3``): the cluster, its leader, member loss."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from elasticrun.store.server import EtcdCluster, EtcdServer

from .faults import Fault, Kind


def member_id(m: EtcdServer) -> Optional[Tuple[str, str]]:
    """(member id, leader id) from the member's v3 status API (the gateway of ``etcdctl endpoint status``)."""
    req = urllib.request.Request(f"http://{m.endpoint}/v3/maintenance/status", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            doc = json.loads(resp.read())
    except (OSError, ValueError):
        return None
    return str(doc.get("header", {}).get("member_id")), str(doc.get("leader"))


class Members:
    """A local 3-member etcd cluster in ``base``; each member's data survives its SIGKILL."""

    def __init__(self, base: Path, size: int = 3) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.cluster = EtcdCluster(size, base_dir=str(base))
        for m in self.cluster.members.values():
            m.log_path = str(base / f"{m.name}.log")

    @property
    def endpoints(self) -> str:
        return self.cluster.endpoints

    def start(self, timeout: float = 60.0) -> None:
        self.cluster.start(timeout)

    def running(self) -> List[EtcdServer]:
        return [m for m in self.cluster.members.values() if m.running()]

    def leader(self, timeout: float = 20.0) -> Optional[EtcdServer]:
        """The member that says it is the leader (None if none does within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.running():
                ids = member_id(m)
                if ids is not None:
                    me, lead = ids
                    if lead not in ("None", "0") and me == lead:
                        return m
            time.sleep(0.2)
        return None

    def lose(self, f: Fault, sleep: Callable[[float], None], while_down: Callable[[], None]) -> None:
        """SIGKILL the leader (``leader_loss``) or a follower (``member_loss``, picked by ``f.pick``),
        ``sleep`` for ``f.duration``, call ``while_down``, start it again on its data; sets
        ``f.target``, or ``f.skipped`` when there is no such member."""
        leader = self.leader()
        if f.kind is Kind.LEADER_LOSS:
            victims = [leader] if leader is not None else []
        else:
            victims = [m for m in self.running() if m is not leader]
        if not victims:
            f.skipped = "no etcd leader found" if f.kind is Kind.LEADER_LOSS else "no follower running"
            return
        m = victims[int(f.pick * len(victims)) % len(victims)]
        f.target = f"etcd member {m.name} ({'leader' if m is leader else 'follower'}) down {f.duration:.1f}s"
        m.kill()
        sleep(f.duration)
        while_down()
        m.restart(timeout=60)

    def stop(self) -> None:
        self.cluster.stop()


__all__ = ["Members", "member_id"]
