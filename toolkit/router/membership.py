"""Which replicas serve, the router's part: registration, the readiness probe, heartbeats, and
dropping a replica that died (no heartbeat for ``missed_heartbeats`` intervals, no token for
``stall_timeout_s`` with work in flight, or a re-registration under the same id). What a dropped
replica held goes back to the router (``orphaned``), which requeues or fails it."""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable

from toolkit.config import RouterConfig
from toolkit.core import clock
from toolkit.core import protocol as P
from toolkit.router.elastic import Elastic
from toolkit.router.pool import ReplicaPool
from toolkit.router.queue import Request
from toolkit.router.replica import Replica, Send
from toolkit.router.weights import WeightSync

logger = logging.getLogger(__name__)

PROBE_PREFIX = "__probe__:"
ABSENCES_KEPT = 256
"""The router's recent absences kept to credit its replicas' silence (older ones only lengthen a
silence already past any limit)."""


class Membership:
    def __init__(self, rcfg: RouterConfig, pool: ReplicaPool, weights: WeightSync, elastic: Elastic,
                 send_to_replica: Send, orphaned: Callable[[Replica, list[Request], str, bool], None]) -> None:
        self.rcfg = rcfg
        self.pool = pool
        self.weights = weights
        self.elastic = elastic
        self.send = send_to_replica
        self.orphaned = orphaned
        """Takes the requests a dropped replica held (and why it was dropped)."""
        self.events: Counter[str] = Counter()
        """engine_deaths."""
        self._probes = 0
        self._checked_at: float | None = None
        self._absences: deque[tuple[float, float]] = deque(maxlen=ABSENCES_KEPT)
        """The router's recent absences: (when it came back, the seconds it was away beyond a heartbeat)."""
        self._warned_at = float("-inf")

    def heartbeat(self, ident: bytes, msg: P.Heartbeat) -> None:
        r = self.pool.known(ident)
        if r is None:
            if not self.elastic.refuse_retired(ident, msg.replica_id):
                self.send(ident, P.Reregister("unknown replica"))
            return
        now = clock.monotonic()
        interval, r.last_seen = now - r.last_seen, now
        before, s = r.stats, msg.stats
        r.stats = s
        r.speed.update(now, s.generated_tokens, s.running)
        if r.heartbeats:  # the first heartbeat after (re-)registering sets the baseline, counted before
            self.pool.count_generated(r, before, s, interval)
        r.heartbeats += 1
        if s.generated_tokens != before.generated_tokens:
            r.progress_at = now
        if r.draining:
            self.elastic.shutdown_if_idle(r)

    def register(self, ident: bytes, msg: P.Register) -> None:
        if self.elastic.refuse_retired(ident, msg.replica_id):
            return
        was_draining = False
        old = self.pool.get(msg.replica_id)
        if old is not None:
            was_draining = old.draining
            self.drop(old, "re-registered")
        same = self.pool.known(ident)
        if same is not None:
            self.drop(same, "re-registered")
        r = Replica(msg.replica_id, ident, msg.group, msg.max_inflight, msg.max_model_len, msg.vocab_size,
                    msg.model, dict(msg.labels), msg.streams, max(1, msg.stream_ranks), msg.kv_block_size,
                    msg.kv_capacity_tokens, last_seen=clock.monotonic())
        self.pool.add(r)
        if was_draining:
            # It stays on its way out: never probed into service; it holds nothing now, so it stops.
            self.pool.set_draining(r)
            self.elastic.shutdown_if_idle(r)
            return
        logger.info("replica %s registered (group %s, max_inflight %d)", r.replica_id, r.group, r.max_inflight)
        self.weights.registered(r, msg.weights)
        self._probe(r)

    def probe_answered(self, r: Replica, res: P.Result) -> None:
        """A replica that serves its probe is ready, once it holds the run's weights too."""
        if r.ready or r.draining:
            return
        if res.status != "ok" or not res.output_token_ids:
            logger.warning("probe of %s failed: %s %s", r.replica_id, res.status, res.error)
        elif self.weights.admit(r):
            self.pool.set_ready(r)

    def _probe(self, r: Replica) -> None:
        """Readiness is a real generation, not a health flag: send one token's worth of work."""
        self._probes += 1
        probe = P.Generate(request_id=f"{PROBE_PREFIX}{r.replica_id}:{self._probes}", job="__probe__",
                           prompt_token_ids=[1, 2, 3], sampling=P.Sampling(max_tokens=1))
        r.probe_sent_at = clock.monotonic()
        self.send(r.identity, probe)

    def drop(self, r: Replica, why: str, blame: bool = True) -> None:
        """Remove a replica; the router takes back what it held (``blame``: its requests in flight count
        a death each; not for a replica that said it is leaving)."""
        if r.shutdown_sent and not r.inflight:
            logger.info("replica %s is gone after its shutdown (%s)", r.replica_id, why)
        else:
            logger.warning("dropping replica %s (%s) with %d request(s) in flight", r.replica_id, why, r.load)
        orphans = self.pool.remove(r)
        self.weights.forget(r)
        self.orphaned(r, orphans, why, blame)

    def engine_died(self, r: Replica, why: str) -> None:
        """A replica answered ``engine_dead``: out of dispatch until a new probe passes its gate (its
        engine restarted). Requests wait in the router meanwhile, not at its gate: a replica that ends
        instead (an engine that cannot restart: a lost node of a multi-node replica) takes none of them
        along, so one failure counts once toward a request's ``max_engine_deaths``."""
        if not r.ready or r.draining:
            return
        logger.warning("the engine of %s died (%s): out of dispatch until it serves a probe again", r.replica_id, why)
        self.pool.set_unready(r)
        self.events["engine_deaths"] += 1
        self._probe(r)

    def check(self, now: float) -> None:
        """The sweep's part: drop the silent and the stalled, probe again an unanswered probe."""
        silent_after = self.rcfg.heartbeat_s * self.rcfg.missed_heartbeats
        self._note_absence(now)
        away = self._away_since if self._absences else _never
        for r in list(self.pool.all()):
            if now - r.last_seen - away(r.last_seen) > silent_after:
                self.drop(r, f"no heartbeat for {now - r.last_seen:.1f}s")
            elif (r.ready and r.inflight and now - r.progress_at - away(r.progress_at) > self.rcfg.stall_timeout_s
                  and not self.weights.is_loading(r)):
                # Heartbeats alone prove nothing: an engine can beat while generation hangs.
                self.drop(r, f"no token generated for {now - r.progress_at:.1f}s with {r.load} in flight")
            elif not r.ready and not r.draining and now - r.probe_sent_at > self.rcfg.probe_timeout_s:
                if self.weights.retry_failed_load(r):
                    r.probe_sent_at = now  # the next retry after another probe timeout
                else:
                    logger.warning("probe of %s unanswered after %.0fs; probing again", r.replica_id,
                                   self.rcfg.probe_timeout_s)
                    self._probe(r)
        if self._absences:  # those before every replica's last heartbeat and progress count for none
            oldest = min((min(r.last_seen, r.progress_at if r.inflight else now) for r in self.pool.all()), default=now)
            while self._absences and self._absences[0][0] <= oldest:
                self._absences.popleft()

    def _note_absence(self, now: float) -> None:
        """A router away for more than two heartbeats between checks (its loop stalled, its process
        descheduled on a loaded node) heard nothing meanwhile, nor read what reached its socket's buffers:
        that time, beyond a heartbeat, is not the replicas' silence (nor their stall). Only that time: a
        router that is away again and again still finds a dead replica, a heartbeat's time a check."""
        last, self._checked_at = self._checked_at, now
        if last is None or now - last <= 2 * self.rcfg.heartbeat_s:
            return
        self._absences.append((now, now - last - self.rcfg.heartbeat_s))
        self.events["router_absences"] += 1
        if now - self._warned_at > 60:
            self._warned_at = now
            logger.warning("the router was away for %.1fs between checks: that time is not its replicas' silence "
                           "(%d such absence(s) so far)", now - last, self.events["router_absences"])

    def _away_since(self, t: float) -> float:
        """Seconds the router was away (beyond a heartbeat each time) after ``t``."""
        return sum(excess for back, excess in self._absences if back > t)


def _never(t: float) -> float:
    return 0.0
