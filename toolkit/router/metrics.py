"""The router's Prometheus metrics. Counts the router keeps anyway are read when Prometheus scrapes
(a collector, nothing on the hot path); the hot path adds one counter increment and two histogram
observations per completed request, and times one dispatch decision in :data:`DECISION_SAMPLE`."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from toolkit.router.policy import Replica
    from toolkit.router.queue import Request
    from toolkit.router.server import Router

DECISION_SAMPLE = 16
"""One dispatch decision in this many is timed."""
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RouterMetrics(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router
        self.registry = CollectorRegistry()
        self.requests: Counter[tuple[str, str, str]] = Counter()
        """Completed requests by (job, group that ran it or "none", status)."""
        self.latency = Histogram("toolkit_router_request_seconds", "Submission to Result, per request",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_wait = Histogram("toolkit_router_queue_wait_seconds", "Submission to (last) dispatch",
                                    buckets=LATENCY_BUCKETS, registry=self.registry)
        self.decision = Histogram("toolkit_router_dispatch_decision_seconds",
                                  f"Time of a dispatch decision (one in {DECISION_SAMPLE} timed)",
                                  buckets=(1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 1e-2), registry=self.registry)
        self._n = 0
        self.registry.register(self)

    def completed(self, req: Request, status: str, now: float) -> None:
        self.requests[(req.job, req.group or "none", status)] += 1
        self.latency.observe(now - req.t_submit)
        if req.t_dispatch:
            self.queue_wait.observe(max(0.0, req.t_dispatch - req.t_submit))

    def sampled(self, decide: Callable[[Request], Replica | None]) -> Callable[[Request], Replica | None]:
        """``decide``, one call in :data:`DECISION_SAMPLE` timed into the decision histogram."""

        def choose(req: Request) -> Replica | None:
            self._n += 1
            if self._n % DECISION_SAMPLE:
                return decide(req)
            t0 = time.perf_counter()
            r = decide(req)
            self.decision.observe(time.perf_counter() - t0)
            return r

        return choose

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        r = self.router
        # Read on the scrape thread while the router loop runs: copy first (a dict that changes size
        # under iteration raises), and try again on the rare race.
        for _ in range(3):
            try:
                replicas = list(r.replicas.values())
                jobs = [(name, q.size) for name, q in list(r.queue.jobs.items())]
                requests = list(self.requests.items())
                stats = list(r.stats.items())
                break
            except RuntimeError:
                time.sleep(0.001)
        else:
            return
        c = CounterMetricFamily("toolkit_router_requests", "Requests answered, by job, group and status",
                                labels=["job", "group", "status"])
        for (job, group, status), n in requests:
            c.add_metric([job, group, status], n)
        yield c
        q = GaugeMetricFamily("toolkit_router_queue_depth", "Requests waiting in the router", labels=["job"])
        for name, size in jobs:
            q.add_metric([name], size)
        yield q
        per_replica = {
            "inflight": ("toolkit_router_replica_inflight", "Requests in flight on the replica", GaugeMetricFamily,
                         lambda x: x.load),
            "hits": ("toolkit_router_replica_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                     CounterMetricFamily, lambda x: x.prefix_hits),
            "queries": ("toolkit_router_replica_prefix_cache_query_tokens", "Prompt tokens looked up in the cache",
                        CounterMetricFamily, lambda x: x.prefix_queries),
            "tokens": ("toolkit_router_replica_generated_tokens", "Tokens the replica's engine generated",
                       CounterMetricFamily, lambda x: x.generated),
            "version": ("toolkit_router_replica_weight_version", "Weight version the replica serves",
                        GaugeMetricFamily, lambda x: x.weight_version),
            "speed": ("toolkit_router_replica_tokens_per_second", "Decode rate learned from heartbeats",
                      GaugeMetricFamily, lambda x: x.speed.tokens_per_s),
        }
        for name, help_text, kind, value in per_replica.values():
            fam = kind(name, help_text, labels=["replica", "group"])
            for rep in replicas:
                fam.add_metric([rep.replica_id, rep.group], value(rep))
            yield fam
        events = CounterMetricFamily("toolkit_router_events", "Router events: flips, migrations by reason, "
                                     "requeues after engine deaths, duplicates, malformed messages...",
                                     labels=["event"])
        for key, n in stats:
            events.add_metric([key], n)
        yield events
