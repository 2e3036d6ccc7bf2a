"""A replica's Prometheus metrics (``report.metrics``). The engine's own counters (load, prefix cache,
generated tokens, weight version) are read from the snapshot the last heartbeat took, so a scrape never
calls into the engine from the server's thread; the replica's own events are counted as they happen."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from toolkit.core.protocol import ReplicaStats

LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class ReplicaMetrics(Collector):
    def __init__(self, inflight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.stats: ReplicaStats | None = None
        """The engine's counters at the last heartbeat."""
        self.inflight = inflight
        """Requests the replica holds (at its gate or in the engine)."""
        self.requests = Counter("toolkit_replica_requests", "Results sent to the router, by job and status",
                                ["job", "status"], registry=self.registry)
        self.tokens = Counter("toolkit_replica_result_tokens", "Generated tokens in the Results sent, by job",
                              ["job"], registry=self.registry)
        self.latency = Histogram("toolkit_replica_request_seconds", "Receipt of a Generate to its Result",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.deaths = Counter("toolkit_replica_engine_deaths", "Engine deaths the replica noticed",
                              registry=self.registry)
        self.restarts = Counter("toolkit_replica_engine_restarts", "Engine restarts that succeeded",
                                registry=self.registry)
        self.weight_loads = Counter("toolkit_replica_weight_loads", "Weight loads, by how and result",
                                    ["mode", "result"], registry=self.registry)
        self.registry.register(self)

    def result(self, job: str, status: str, tokens: int, seconds: float) -> None:
        self.requests.labels(job, status).inc()
        self.tokens.labels(job).inc(tokens)
        self.latency.observe(seconds)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield GaugeMetricFamily("toolkit_replica_inflight", "Requests the replica holds", value=self.inflight())
        s = self.stats
        if s is None:
            return
        yield GaugeMetricFamily("toolkit_replica_running", "Requests the engine runs", value=s.running)
        yield GaugeMetricFamily("toolkit_replica_waiting", "Requests waiting in the engine", value=s.waiting)
        yield GaugeMetricFamily("toolkit_replica_kv_cache_usage", "Share of the KV cache in use", value=s.kv_usage)
        yield CounterMetricFamily("toolkit_replica_prefix_cache_hit_tokens", "Prompt tokens found in the "
                                  "prefix cache", value=s.prefix_hits)
        yield CounterMetricFamily("toolkit_replica_prefix_cache_query_tokens", "Prompt tokens looked up in "
                                  "the prefix cache", value=s.prefix_queries)
        yield CounterMetricFamily("toolkit_replica_generated_tokens", "Tokens the engine generated (readiness "
                                  "probes and aborted requests included)", value=s.generated_tokens)
        yield GaugeMetricFamily("toolkit_replica_weight_version", "Weight version the engine serves",
                                value=s.weight_version)
