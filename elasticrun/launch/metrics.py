"""The agent's ``/metrics`` endpoint (``--metrics-port``): Prometheus text, OpenMetrics on request.

Exposition is prometheus-client's: a private :class:`CollectorRegistry` (never the process-global
one), rendered at most once per :data:`CACHE_S` (a scrape storm shares one render) and served by
:class:`~elasticrun.launch.httpserve.BoundedHTTPServer` on one daemon thread (connections bounded in
number and time, none costs a thread), so a slow, stormy or hostile client never touches the agent
loop. Gauges
and counters are read at scrape time from the agent's :class:`~elasticrun.launch.observe.Observer`
snapshot (a dict copied under its lock); histograms are observed where the durations happen. Every
series carries ``job_id`` and ``node_id``; the node's role (leader/member) is on
``elasticrun_agent_info`` so other series keep their identity when leadership moves. The metric list
and their meaning: docs/observability.md.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from elasticrun.errors import ConfigError
from elasticrun.launch.goodput import LOST_CAUSES, Cause, Phase
from elasticrun.launch.httpserve import BoundedHTTPServer

PREFIX = "elasticrun_"
ETCD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SAVE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
LEASE_STATES = ("held", "in_doubt", "lost")
CACHE_S = 0.5  # a rendered exposition serves every scrape for this long (concurrent scrapes share one render)


class _StateCollector:
    """Gauges and counters built from ``snapshot()`` at every scrape."""

    def __init__(self, labels: Dict[str, str], snapshot: Callable[[], Dict[str, Any]]) -> None:
        self.names = list(labels)
        self.values = [labels[n] for n in self.names]
        self.snapshot = snapshot

    def _gauge(self, name: str, doc: str, value: Optional[float]) -> Optional[Metric]:
        if value is None:
            return None
        g = GaugeMetricFamily(PREFIX + name, doc, labels=self.names)
        g.add_metric(self.values, float(value))
        return g

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        c = CounterMetricFamily(PREFIX + name, doc, labels=self.names)
        c.add_metric(self.values, float(value))
        return c

    def _by(self, family: Any, label: str, values: Dict[str, float]) -> Metric:
        for key, v in values.items():
            family.add_metric([*self.values, key], float(v))
        return family

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        g = self._gauge
        found: List[Optional[Metric]] = [
            g("world_size", "Workers in the current round (0 before the first round).", s.get("world_size", 0)),
            g("round", "The current rendezvous round (-1 before the first).", s.get("round", -1)),
            g("nodes", "Nodes in the current round.", s.get("nodes", 0)),
            g("step", "The latest training step this node's workers reported.", s.get("step")),
            g("samples_per_second", "Samples per second (global) at the latest report.", s.get("samples_per_s")),
            g("goodput_ratio", "Wall time that became kept training, over wall time since the agent started.",
              s.get("goodput_ratio", 0.0)),
            g("goodput_seconds", "Seconds of kept training so far (a gauge: falls when a restore throws "
              "training away; rates: phase_seconds_total{phase=\"training\"} - training_lost_seconds_total).",
              s.get("goodput_s", 0.0)),
            g("leader", "1 while this agent leads the rendezvous.", 1.0 if s.get("role") == "leader" else 0.0),
            g("straggler", "1 while the leader scores this node a straggler (--straggler-threshold).",
              1.0 if s.get("straggler") else 0.0),
            self._counter("restarts_total", "Worker-failure restarts of the job.", s.get("restarts", 0)),
            self._counter("steps_lost_total", "Steps thrown away by restores (rollback).", s.get("steps_lost", 0)),
        ]
        yield from (m for m in found if m is not None)
        info = GaugeMetricFamily(PREFIX + "agent_info", "This agent: its role (leader or member).",
                                 labels=[*self.names, "role"])
        info.add_metric([*self.values, str(s.get("role", "member"))], 1.0)
        yield info
        yield self._by(CounterMetricFamily(PREFIX + "rescales_total", "Rounds formed by a membership change.",
                                           labels=[*self.names, "type"]), "type", s.get("rescales", {}))
        yield self._by(CounterMetricFamily(PREFIX + "recoveries_total", "Worker-failure recoveries by how: in_place "
                                           "(survivors kept their processes) or restart (every worker restarted).",
                                           labels=[*self.names, "how"]), "how",
                       {"in_place": 0, "restart": 0, **s.get("recoveries", {})})
        counters = s.get("counters", {})
        phases, badput, lost = (counters.get(k, {}) for k in ("phase_s", "badput_s", "lost_s"))
        yield self._by(CounterMetricFamily(PREFIX + "phase_seconds_total", "Wall seconds spent in each phase, "
                                           "as lived (training includes what was found lost afterwards).",
                                           labels=[*self.names, "phase"]), "phase",
                       {p.value: phases.get(p.value, 0.0) for p in Phase if p is not Phase.CHECKPOINT_STALL})
        yield self._by(CounterMetricFamily(PREFIX + "badput_seconds_total", "Wall seconds not kept, by cause.",
                                           labels=[*self.names, "cause"]), "cause",
                       {c.value: badput.get(c.value, 0.0) for c in Cause})
        yield self._by(CounterMetricFamily(PREFIX + "training_lost_seconds_total", "Training seconds found "
                                           "afterwards not kept, by cause (goodput = training - these).",
                                           labels=[*self.names, "cause"]), "cause",
                       {c.value: lost.get(c.value, 0.0) for c in LOST_CAUSES})
        yield self._by(GaugeMetricFamily(PREFIX + "rank_compute_seconds", "Each rank of this node: its mean "
                                         "compute seconds per step (outside collectives), as last scored.",
                                         labels=[*self.names, "rank"]), "rank", s.get("rank_compute") or {})
        lease = s.get("lease", "lost")
        yield self._by(GaugeMetricFamily(PREFIX + "lease_state", "1 for the state the agent's etcd lease is in.",
                                         labels=[*self.names, "state"]), "state",
                       {state: 1.0 if state == lease else 0.0 for state in LEASE_STATES})


class _CachedApp:
    """The handler: ``/metrics`` rendered at most once per :data:`CACHE_S` per format (text or
    OpenMetrics); concurrent scrapes wait for the one render in flight, so a scrape storm costs the
    agent one render per half second, not one per scrape."""

    def __init__(self, registry: CollectorRegistry, ttl: float = CACHE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry, self.ttl, self.clock = registry, ttl, clock
        self._lock = threading.Lock()
        self._cache: Dict[str, Tuple[float, bytes]] = {}  # content type -> (rendered at, body)
        self.renders = 0

    def render(self, accept: str) -> Tuple[str, bytes]:
        """(content type, body) for an ``Accept`` header, from the cache while fresh."""
        encoder, content_type = choose_encoder(accept)
        with self._lock:
            hit = self._cache.get(content_type)
            if hit is None or self.clock() - hit[0] >= self.ttl:
                hit = (self.clock(), encoder(self.registry))
                self._cache[content_type] = hit
                self.renders += 1
        return content_type, hit[1]

    def __call__(self, method: str, path: str, headers: Dict[str, str]) -> Tuple[str, List[Tuple[str, str]], bytes]:
        """The answer to one request (see :data:`elasticrun.launch.httpserve.Handler`)."""
        if path not in ("/", "/metrics"):
            return "404 Not Found", [("Content-Type", "text/plain")], b"not found: try /metrics\n"
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", [("Content-Type", "text/plain"), ("Allow", "GET, HEAD")], \
                b"only GET and HEAD\n"
        content_type, body = self.render(headers.get("accept", ""))
        return "200 OK", [("Content-Type", content_type)], body


class Metrics:
    """The registry, its histograms, and (once :meth:`serve` ran) the HTTP server."""

    def __init__(self, job_id: str, node_id: str, snapshot: Callable[[], Dict[str, Any]]) -> None:
        self.labels = {"job_id": job_id, "node_id": node_id}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_StateCollector(self.labels, snapshot))  # type: ignore[arg-type]
        names = list(self.labels)
        self.etcd = Histogram(PREFIX + "etcd_request_seconds", "Duration of the agent's etcd calls (with retries).",
                              [*names, "op"], registry=self.registry, buckets=ETCD_BUCKETS)
        self.checkpoint = Histogram(PREFIX + "checkpoint_seconds", "Workers' checkpoint saves (blocking part).",
                                    names, registry=self.registry, buckets=SAVE_BUCKETS).labels(**self.labels)
        self.snapshot = Histogram(PREFIX + "snapshot_seconds", "Workers' memory snapshots (blocking part).",
                                  names, registry=self.registry, buckets=SAVE_BUCKETS).labels(**self.labels)
        self.app = _CachedApp(self.registry)
        self.server: Optional[BoundedHTTPServer] = None

    def observe_etcd(self, op: str, seconds: float) -> None:
        """Hook for :attr:`elasticrun.store.client.EtcdStore.on_call`."""
        self.etcd.labels(op=op, **self.labels).observe(seconds)

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (see launch/httpserve.py for the bounds on clients); the
        port bound (``port`` 0: any). ConfigError (one line) when the address cannot be bound."""
        server = BoundedHTTPServer(self.app, name="elasticrun-metrics")
        try:
            bound = server.start(host, port)
        except OSError as err:
            raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} ({err.strerror or err}); "
                              "pick a free port, or 0 to turn metrics off") from None
        self.server = server
        return bound

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


__all__ = ["Metrics"]
