"""The router's Prometheus metrics, served from a snapshot the router's loop publishes at each sweep.

The loop writes everything here (one list append per completed request on the hot path, folded in bulk
at the sweep) and publishes an immutable :class:`Snapshot` with one reference swap; the scrape thread
reads only the latest snapshot, so a scrape is at most one sweep (a quarter second) behind and never
sees a structure the loop is changing. Method and costs: docs/benchmarks.md#router.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from toolkit.core.protocol import KvStatus
from toolkit.router.queue import Request
from toolkit.router.replica import Replica

DECISION_SAMPLE = 16
"""Dispatch decisions timed after each sweep (every quarter second at most)."""
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass(frozen=True)
class HistogramState:
    name: str
    documentation: str
    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    """Per bucket, not cumulative; the last is above every bound (+Inf)."""
    total: float

    def family(self) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        return HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.total)


class LoopHistogram:
    """A histogram the router's loop writes without a lock; a scrape reads its :meth:`state`."""

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

    def state(self) -> HistogramState:
        return HistogramState(self.name, self.documentation, self.bounds, tuple(self.counts), self.sum)

    def family(self) -> HistogramMetricFamily:
        return self.state().family()


@dataclass(frozen=True)
class ReplicaRow:
    """One replica heard from, as a scrape shows it."""

    replica_id: str
    group: str
    inflight: int
    prefix_hits: int
    prefix_queries: int
    generated_tokens: int
    weight_version: int
    tokens_per_s: float


@dataclass(frozen=True)
class Snapshot:
    """What a scrape shows, as of one sweep of the router's loop."""

    requests: tuple[tuple[tuple[str, str, str], int], ...] = ()
    """Completed requests by (job, group that ran it or "none", status)."""
    queue_depth: tuple[tuple[str, int], ...] = ()
    replicas: tuple[ReplicaRow, ...] = ()
    events: tuple[tuple[str, int], ...] = ()
    histograms: tuple[HistogramState, ...] = ()
    kv: KvStatus | None = None
    """The KV index and budget (``router.policy=kv_aware``, ``router.kv_budget``), when on."""


class RouterMetrics(Collector):
    def __init__(self) -> None:
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
        self.snapshot = Snapshot()
        """The latest published state: the only thing the scrape thread reads."""
        self.registry.register(self)

    # ---- the router's loop -----------------------------------------------------------------
    def completed(self, req: Request, status: str, now: float) -> None:
        # One append: this runs once per request on the router's hot path.
        self._done.append((req.job, req.group, status, now - req.t_submit,
                           req.t_dispatch - req.t_submit if req.t_dispatch else -1.0))

    def publish(self, replicas: Iterable[Replica], queue_depth: list[tuple[str, int]],
                events: Mapping[str, int], kv: KvStatus | None = None) -> None:
        """At the sweep: fold the completions since the last one, then publish what a scrape shows."""
        self._fold()
        # Only replicas heard from: one that registers again (a router restart, a drop) would show its
        # engine's counters as 0 until its first heartbeat, and Prometheus would read a reset.
        rows = tuple(ReplicaRow(r.replica_id, r.group, r.load, r.stats.prefix_hits, r.stats.prefix_queries,
                                r.stats.generated_tokens, r.stats.weight_version, r.speed.tokens_per_s)
                     for r in replicas if r.heartbeats)
        self.snapshot = Snapshot(tuple(self.requests.items()), tuple(queue_depth), rows, tuple(events.items()),
                                 (self.latency.state(), self.queue_wait.state(), self.decision.state()), kv)

    def _fold(self) -> None:
        if not self._done:
            return
        done, self._done = self._done, []
        jobs, groups, statuses, latency, wait = zip(*done, strict=True)
        self.requests.update(zip(jobs, (g or "none" for g in groups), statuses, strict=True))  # counted in C
        self.latency.observe_many(np.asarray(latency, dtype=np.float64))
        waits = np.asarray(wait, dtype=np.float64)
        self.queue_wait.observe_many(np.maximum(waits[waits >= 0], 0.0))

    def timer(self, decide: Callable[[Request], Replica | None]) -> DecisionTimer:
        return DecisionTimer(decide, self.decision)

    # ---- the scrape thread -----------------------------------------------------------------
    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        snap = self.snapshot
        c = CounterMetricFamily("toolkit_router_requests", "Requests answered, by job, group and status",
                                labels=["job", "group", "status"])
        for (job, group, status), n in snap.requests:
            c.add_metric([job, group, status], n)
        yield c
        q = GaugeMetricFamily("toolkit_router_queue_depth", "Requests waiting in the router", labels=["job"])
        for name, size in snap.queue_depth:
            q.add_metric([name], size)
        yield q
        per_replica: list[tuple[str, str, type[CounterMetricFamily] | type[GaugeMetricFamily],
                                Callable[[ReplicaRow], float]]] = [
            ("toolkit_router_replica_inflight", "Requests in flight on the replica", GaugeMetricFamily,
             lambda x: x.inflight),
            ("toolkit_router_replica_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
             CounterMetricFamily, lambda x: x.prefix_hits),
            ("toolkit_router_replica_prefix_cache_query_tokens", "Prompt tokens looked up in the cache",
             CounterMetricFamily, lambda x: x.prefix_queries),
            ("toolkit_router_replica_generated_tokens", "Tokens the replica's engine generated",
             CounterMetricFamily, lambda x: x.generated_tokens),
            ("toolkit_router_replica_weight_version", "Weight version the replica serves", GaugeMetricFamily,
             lambda x: x.weight_version),
            ("toolkit_router_replica_tokens_per_second", "Decode rate learned from heartbeats", GaugeMetricFamily,
             lambda x: x.tokens_per_s),
        ]
        for name, help_text, kind, value in per_replica:
            fam = kind(name, help_text, labels=["replica", "group"])
            for row in snap.replicas:
                fam.add_metric([row.replica_id, row.group], value(row))
            yield fam
        events = CounterMetricFamily("toolkit_router_events", "Router events: flips, migrations by reason, "
                                     "requeues after engine deaths, duplicates, malformed messages...",
                                     labels=["event"])
        for key, n in snap.events:
            events.add_metric([key], n)
        yield events
        for histogram in snap.histograms:
            yield histogram.family()
        if snap.kv is not None:
            yield from _kv_families(snap.kv)


KV_GAUGES = (
    ("toolkit_router_kv_index_blocks", "Distinct blocks some replica's prefix cache holds, by the engines' events",
     "index_blocks"),
    ("toolkit_router_kv_events_per_second", "KV block events the router applied per second", "events_per_s"),
    ("toolkit_router_kv_predicted_hit", "Share of dispatched prompt tokens the index said were cached there",
     "predicted_hit"),
    ("toolkit_router_kv_reported_hit", "Share of prompt tokens the engines found cached (their counters)",
     "reported_hit"),
    ("toolkit_router_kv_admitted_sessions", "Sessions holding a KV reservation (router.kv_budget)", "admitted_sessions"),
)


def _kv_families(kv: KvStatus) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    for name, help_text, field in KV_GAUGES:
        yield GaugeMetricFamily(name, help_text, value=getattr(kv, field))
    yield CounterMetricFamily("toolkit_router_kv_events", "KV block events the router applied", value=kv.events)
    yield CounterMetricFamily("toolkit_router_kv_resyncs", "KV snapshots the router asked replicas for",
                              value=kv.resyncs)
    per = (("toolkit_router_kv_replica_cached_blocks", "Blocks the replica's prefix cache holds", kv.cached_blocks),
           ("toolkit_router_kv_replica_reserved_tokens", "KV tokens its admitted sessions reserve", kv.reserved_tokens))
    for name, help_text, values in per:
        fam = GaugeMetricFamily(name, help_text, labels=["replica"])
        for rid, n in values.items():
            fam.add_metric([rid], n)
        yield fam


class DecisionTimer:
    """The router's dispatch decision, timing its next :data:`DECISION_SAMPLE` calls after each
    :meth:`arm` into the decision histogram. The router calls it only while :attr:`left` is not 0, so
    between samples its decisions pay nothing (a wrapper on every call cost ~0.6 us a dispatch, and a
    dispatch makes several decisions)."""

    __slots__ = ("decide", "histogram", "left")

    def __init__(self, decide: Callable[[Request], Replica | None], histogram: LoopHistogram) -> None:
        self.decide = decide
        self.histogram = histogram
        self.left = 0

    def arm(self) -> None:
        self.left = DECISION_SAMPLE

    def __call__(self, req: Request) -> Replica | None:
        if self.left <= 0:
            return self.decide(req)
        t0 = time.perf_counter()
        r = self.decide(req)
        self.histogram.observe(time.perf_counter() - t0)
        self.left -= 1
        return r
