"""A rank's Prometheus metrics (``report.metrics``): its sessions and requests as they end, and where
the running step is. Summed over ranks, the counts of a step equal its step report's."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from toolkit.core.protocol import Result

LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RankMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.step = Gauge("toolkit_rank_step", "The step the rank runs (or ran last)", registry=r)
        self.step_sessions = Gauge("toolkit_rank_step_sessions", "The rank's sessions in its step", registry=r)
        self.step_done = Gauge("toolkit_rank_step_sessions_done", "Sessions of the step the rank has ended",
                               registry=r)
        self.sessions = Counter("toolkit_rank_sessions", "Sessions ended, by their sample status", ["status"],
                                registry=r)
        self.requests = Counter("toolkit_rank_requests", "Generation requests answered, by group and status",
                                ["group", "status"], registry=r)
        self.tokens = Counter("toolkit_rank_generated_tokens", "Generated tokens the rank received", registry=r)
        self.latency = Histogram("toolkit_rank_request_seconds", "A generation request, sent to answered",
                                 buckets=LATENCY_BUCKETS, registry=r)

    def begin(self, step: int, sessions: int) -> None:
        self.step.set(step)
        self.step_sessions.set(sessions)
        self.step_done.set(0)

    def request(self, res: Result, seconds: float) -> None:
        self.requests.labels(res.group or "none", res.status).inc()
        self.tokens.inc(len(res.output_token_ids))
        self.latency.observe(seconds)

    def session_done(self, status: str) -> None:
        self.sessions.labels(status).inc()
        self.step_done.inc()
