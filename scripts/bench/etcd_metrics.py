"""etcd's own counters from its ``/metrics`` page (plain HTTP only), for the rendezvous bench and its test."""

from __future__ import annotations

import re
import urllib.request
from typing import Dict

from elasticrun.store.types import parse_endpoints

_LINE = re.compile(r"([a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$")
_METHOD = re.compile(r'grpc_method="([A-Za-z]+)"')
_NAMES = {
    "process_cpu_seconds_total": "cpu_s",
    "etcd_debugging_mvcc_current_revision": "revision",  # one per committed write transaction
    "etcd_debugging_mvcc_events_total": "events_sent",  # watch events sent to watchers
    "etcd_server_proposals_committed_total": "proposals",  # raft entries: writes, lease grants, failed txns
}
_STREAMS = ("Watch", "LeaseKeepAlive")  # their messages count as requests, but not as unary requests


def etcd_counters(endpoint: str, timeout: float = 10.0) -> Dict[str, float]:
    """``cpu_s``, ``revision``, ``proposals``, ``events_sent``, ``requests`` (every message received) and
    ``unary_requests`` (without watch and keep-alive stream messages) of the first endpoint; ``{}`` when its
    ``/metrics`` cannot be read."""
    host, port = parse_endpoints(endpoint)[0]
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out = {"requests": 0.0, "unary_requests": 0.0}
    for m in filter(None, map(_LINE.match, text.splitlines())):
        name, labels, value = m[1], m[2] or "", float(m[3])
        if name in _NAMES:
            out[_NAMES[name]] = value
        elif name == "grpc_server_msg_received_total":
            out["requests"] += value
            method = _METHOD.search(labels)
            if method is None or method[1] not in _STREAMS:
                out["unary_requests"] += value
    return out

