"""The router's Prometheus metrics. Counts the router keeps anyway are read when Prometheus scrapes
(a collector, nothing on the hot path); the hot path adds one counter increment and two histogram
observations per completed request, and times :data:`DECISION_SAMPLE` dispatch decisions per sweep.

A completion is one list append on the hot path; the router's sweep (every quarter second at most)
folds them in bulk with numpy into the request counter and the :class:`LoopHistogram` buckets, which
only the router's loop writes and a scrape reads (so a scrape is at most one sweep behind).
``prometheus_client``'s own ``Histogram`` takes a lock per observation (~0.55 us each, two per
request): at the router's 40,000 requests/s that was ~7% of its throughput
(``python -m toolkit.bench router``: ``ratio_metrics_on`` 0.926)."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from toolkit.router.policy import Replica
    from toolkit.router.queue import Request
    from toolkit.router.server import Router

DECISION_SAMPLE = 16
"""Dispatch decisions timed after each sweep (every quarter second at most)."""
"""One dispatch decision in this many is timed."""
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class LoopHistogram:
    """A histogram written by one thread without a lock and read by the scrape thread (a scrape may see
    an observation's bucket before its sum: off by one observation, never torn)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le=bound holds value <= bound
        self.sum += value

    def observe_many(self, values: np.ndarray) -> None:
        if not values.size:
            return
        hits = np.bincount(np.searchsorted(self.bounds, values, side="left"), minlength=len(self.counts))
        self.counts = [a + int(b) for a, b in zip(self.counts, hits.tolist(), strict=True)]
        self.sum += float(values.sum())

    def family(self) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        return HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)


class RouterMetrics(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router
        self.registry = CollectorRegistry()
        self.requests: Counter[tuple[str, str, str]] = Counter()
        """Completed requests by (job, group that ran it or "none", status)."""
        self.latency = LoopHistogram("toolkit_router_request_seconds", "Submission to Result, per request",
                                     LATENCY_BUCKETS)
        self.queue_wait = LoopHistogram("toolkit_router_queue_wait_seconds", "Submission to (last) dispatch",
                                        LATENCY_BUCKETS)
        self.decision = LoopHistogram("toolkit_router_dispatch_decision_seconds",
                                      f"Time of a dispatch decision ({DECISION_SAMPLE} timed per router sweep)",
                                      (1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 1e-2))
        self._done: list[tuple[str, str | None, str, float, float]] = []
        """Completions since the last fold: job, group, status, latency, queue wait (-1: never dispatched)."""
        self.registry.register(self)

    def completed(self, req: Request, status: str, now: float) -> None:
        # One append: this runs once per request on the router's hot path.
        self._done.append((req.job, req.group, status, now - req.t_submit,
                           req.t_dispatch - req.t_submit if req.t_dispatch else -1.0))

    def fold(self) -> None:
        """The router's loop, at its sweep: the completions since the last fold into what a scrape reads."""
        if not self._done:
            return
        done, self._done = self._done, []
        jobs, groups, statuses, latency, wait = zip(*done, strict=True)
        requests = self.requests.copy()
        requests.update(zip(jobs, (g or "none" for g in groups), statuses, strict=True))  # counted in C
        self.requests = requests  # swapped whole: the scrape thread reads either one, never one half-way
        self.latency.observe_many(np.asarray(latency, dtype=np.float64))
        waits = np.asarray(wait, dtype=np.float64)
        self.queue_wait.observe_many(np.maximum(waits[waits >= 0], 0.0))

    def timing(self, decide: Callable[[Request], Replica | None],
               done: Callable[[], None]) -> Callable[[Request], Replica | None]:
        """``decide`` timing its next :data:`DECISION_SAMPLE` calls into the decision histogram, then
        calling ``done`` (the router puts the untimed ``decide`` back). The router arms it at every sweep:
        between samples its decisions pay nothing, where a wrapper on every call cost ~0.6 us a dispatch
        (a dispatch makes several decisions)."""
        left = DECISION_SAMPLE

        def choose(req: Request) -> Replica | None:
            nonlocal left
            t0 = time.perf_counter()
            r = decide(req)
            self.decision.observe(time.perf_counter() - t0)
            left -= 1
            if left == 0:
                done()
            return r

        return choose

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
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
        # Only replicas heard from: one that registers again (a router restart, a drop) would show its
        # engine's counters as 0 until its first heartbeat, and Prometheus would read a reset.
        heard = [rep for rep in replicas if rep.heartbeats]
        for name, help_text, kind, value in per_replica.values():
            fam = kind(name, help_text, labels=["replica", "group"])
            for rep in heard:
                fam.add_metric([rep.replica_id, rep.group], value(rep))
            yield fam
        events = CounterMetricFamily("toolkit_router_events", "Router events: flips, migrations by reason, "
                                     "requeues after engine deaths, duplicates, malformed messages...",
                                     labels=["event"])
        for key, n in stats:
            events.add_metric([key], n)
        yield events
        for histogram in (self.latency, self.queue_wait, self.decision):
            yield histogram.family()
