"""Which replicas serve, the router's part: registration, the readiness probe, heartbeats, and
dropping a replica that died (no heartbeat for ``missed_heartbeats`` intervals, no token for
``stall_timeout_s`` with work in flight, or a re-registration under the same id). A dropped replica's
requests go back to the front of their jobs' queues; one that was in flight at ``max_engine_deaths``
deaths fails as ``engine_dead`` instead (a poison request). Slots and groups: ``router/pool.py``.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from toolkit.core import protocol as P
from toolkit.core.sockets import send_msg
from toolkit.router.policy import Replica
from toolkit.router.queue import FairQueue, Request

if TYPE_CHECKING:
    from collections import Counter
    from collections.abc import Callable

    from toolkit.config import RouterConfig
    from toolkit.router.pool import ReplicaPool
    from toolkit.router.tail.routing import TailRouting
    from toolkit.router.timeline import Timeline

logger = logging.getLogger(__name__)

PROBE_PREFIX = "__probe__:"


class MembershipMixin:
    """Part of :class:`toolkit.router.server.Router` (uses its sockets, pool, queue and completion)."""

    # Provided by Router.
    backend: Any
    rcfg: RouterConfig
    pool: ReplicaPool
    replicas: dict[bytes, Replica]
    queue: FairQueue
    timeline: Timeline
    tail: TailRouting
    stats: Counter[str]
    _probe_n: int
    refuse_retired: Callable[[bytes, str], bool]
    shutdown_if_idle: Callable[[Replica], None]
    _push_weights: Callable[[Replica], None]
    held: Callable[[Replica, P.Register], None]
    loading_weights: Callable[[Replica], bool]
    holds_current_weights: Callable[[Replica], bool]
    retry_weights: Callable[[Replica, float], bool]
    _fail: Callable[[Request, str, str], None]

    def heartbeat(self, ident: bytes, msg: P.Heartbeat) -> None:
        r = self.replicas.get(ident)
        if r is None:
            if not self.refuse_retired(ident, msg.replica_id):
                send_msg(self.backend, ident, P.Reregister("unknown replica"))
            return
        r.last_seen = time.monotonic()
        r.running, r.waiting, r.kv_usage = msg.running, msg.waiting, msg.kv_usage
        r.prefix_hits, r.prefix_queries = msg.prefix_hits, msg.prefix_queries
        r.weight_version = msg.weight_version
        r.speed.update(r.last_seen, msg.generated_tokens, msg.running)
        if r.heartbeats:  # the first heartbeat after (re-)registering sets the baseline, counted before
            self.pool.tokens_seen[r.group] += max(0, msg.generated_tokens - r.generated)  # < 0: engine restarted
        r.heartbeats += 1
        if msg.generated_tokens != r.generated:
            r.generated = msg.generated_tokens
            r.progress_at = r.last_seen
        if r.draining:
            self.shutdown_if_idle(r)

    def register(self, ident: bytes, msg: P.Register) -> None:
        if self.refuse_retired(ident, msg.replica_id):
            return
        was_draining = False
        old = self.pool.get(msg.replica_id)
        if old is not None:
            was_draining = old.draining
            self.drop(old, "re-registered")
        if ident in self.replicas:
            self.drop(self.replicas[ident], "re-registered")
        r = Replica(msg.replica_id, ident, msg.group, msg.max_inflight, msg.max_model_len, msg.vocab_size,
                    msg.model, dict(msg.labels), last_seen=time.monotonic())
        self.pool.add(r)
        if was_draining:
            # It stays on its way out: never probed into service; it holds nothing now, so it stops.
            r.draining = True
            self.shutdown_if_idle(r)
            return
        logger.info("replica %s registered (group %s, max_inflight %d)", r.replica_id, r.group, r.max_inflight)
        self.held(r, msg)
        if self.loading_weights(r):
            self._push_weights(r)
        self._probe(r)

    def probe_answered(self, r: Replica, res: P.Result) -> None:
        """A replica that serves its probe is ready, once it holds the run's weights too."""
        if r.ready or r.draining:
            return
        if res.status != "ok" or not res.output_token_ids:
            logger.warning("probe of %s failed: %s %s", r.replica_id, res.status, res.error)
        elif self.holds_current_weights(r):
            self.enter_service(r)
        else:  # ready once it acknowledges them (WeightsMixin.weights_updated)
            r.awaiting_weights = True

    def enter_service(self, r: Replica) -> None:
        r.awaiting_weights = False
        r.weights_error = ""
        self.pool.set_ready(r)

    def _probe(self, r: Replica) -> None:
        """Readiness is a real generation, not a health flag: send one token's worth of work."""
        self._probe_n += 1
        probe = P.Generate(request_id=f"{PROBE_PREFIX}{r.replica_id}:{self._probe_n}", job="__probe__",
                           prompt_token_ids=[1, 2, 3], sampling=P.Sampling(max_tokens=1))
        r.probe_sent_at = time.monotonic()
        send_msg(self.backend, r.identity, probe)

    def drop(self, r: Replica, why: str) -> None:
        """Remove a replica; its in-flight requests go back to the front of their jobs' queues."""
        if r.shutdown_sent and not r.inflight:
            logger.info("replica %s is gone after its shutdown (%s)", r.replica_id, why)
        else:
            logger.warning("dropping replica %s (%s) with %d request(s) in flight", r.replica_id, why, r.load)
        self.pool.remove(r)
        orphans = list(r.inflight.values())
        r.inflight.clear()
        now = time.time()
        for req in orphans:
            assert isinstance(req, Request)
            self.timeline.finished(req.msg.job, req.msg.step, r.group, now)
            self._engine_died_under(req, r.replica_id, why)

    def engine_died(self, r: Replica, why: str) -> None:
        """A replica answered ``engine_dead``: out of dispatch until a new probe passes its gate (its
        engine restarted). Requests wait here meanwhile, not at its gate: a replica that ends instead
        (an engine that cannot restart: a lost node of a multi-node replica) takes none of them along,
        so one failure counts once toward a request's ``max_engine_deaths``."""
        if not r.ready or r.draining:
            return
        logger.warning("the engine of %s died (%s): out of dispatch until it serves a probe again", r.replica_id, why)
        self.pool.withdraw(r)
        r.ready = False
        self.stats["engine_deaths"] += 1
        self._probe(r)

    def _engine_died_under(self, req: Request, replica_id: str, why: str) -> None:
        req.deaths += 1
        req.replica = None
        req.migrating = ""  # requeued whole from its last leg: no partial Result to continue from
        self.tail.forget(req)  # a move it was on is off: it no longer holds the tail group's room
        if req.deaths >= self.rcfg.max_engine_deaths:
            # Poison: this request was in flight at every one of these deaths; stop it killing more.
            self._fail(req, "engine_dead", f"in flight at {req.deaths} engine deaths (last: {replica_id}: {why})")
        else:
            self.queue.requeue_front([req])
            self.stats["requeued"] += 1

    def check_replicas(self, now: float) -> None:
        """The sweep's part: drop the silent and the stalled, probe again an unanswered probe."""
        silent_after = self.rcfg.heartbeat_s * self.rcfg.missed_heartbeats
        for r in list(self.replicas.values()):
            if now - r.last_seen > silent_after:
                self.drop(r, f"no heartbeat for {now - r.last_seen:.1f}s")
            elif (r.ready and r.inflight and now - r.progress_at > self.rcfg.stall_timeout_s
                  and not self.loading_weights(r)):
                # Heartbeats alone prove nothing: an engine can beat while generation hangs.
                self.drop(r, f"no token generated for {now - r.progress_at:.1f}s with {r.load} in flight")
            elif (not r.ready and not r.draining and now - r.probe_sent_at > self.rcfg.probe_timeout_s
                  and not self.retry_weights(r, now)):
                logger.warning("probe of %s unanswered after %.0fs; probing again", r.replica_id,
                               self.rcfg.probe_timeout_s)
                self._probe(r)
