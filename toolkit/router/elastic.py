"""Elastic scale-down, the router's part: draining replicas out (:class:`Elastic`), and groups left with
none (:class:`EmptyGroups`).

``Drain`` takes a replica out of dispatch at once but keeps it known, so its heartbeats and its
in-flight requests' Results still count. With ``migrate`` those requests continue elsewhere from where
they stopped (``migration.py``); without it they finish where they run. A draining replica that holds
nothing gets ``Shutdown``, and its id is retired: a heartbeat or a registration from it gets
``Shutdown`` again, never a welcome.

A group with no serving replica keeps its requests queued; ``router.no_replica_timeout_s`` bounds that
wait: a queued request fails as ``no_replica`` once its target group has been empty, and it has
waited, that long.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from toolkit.config import RouterConfig
from toolkit.core import protocol as P
from toolkit.router.migration import can_continue
from toolkit.router.pool import BULK, PoolKey, ReplicaPool
from toolkit.router.queue import FairQueue, Request
from toolkit.router.replica import Replica, Send
from toolkit.router.tail.routing import TailRouting

logger = logging.getLogger(__name__)

Migrate = Callable[[Request, Replica, str, "str | None"], None]
"""Starts moving a running request off its replica: (request, replica, why, target group or None)."""


class Elastic:
    def __init__(self, pool: ReplicaPool, send_to_replica: Send, migrate: Migrate,
                 drained: Callable[[], None]) -> None:
        self.pool = pool
        self.send = send_to_replica
        self.migrate = migrate
        self.drained = drained
        """Called once a replica left dispatch (a weight update no longer waits for it)."""
        self.retired: set[str] = set()
        """Ids of replicas told to shut down."""

    def drain(self, names: list[str], migrate: bool) -> None:
        """Drain every live replica named in ``names`` (``<group>-<index>``)."""
        wanted = set(names)
        found: set[str] = set()
        for r in list(self.pool.all()):
            name = r.place
            if name in wanted:
                found.add(name)
                if not r.draining:  # else a resend: it is on its way out already
                    self._drain_one(r, migrate)
        for name in sorted(wanted - found):
            # Launch resends until the process is gone: it may have just gone, or not registered yet.
            logger.info("drain: no replica named %s here", name)

    def _drain_one(self, r: Replica, migrate: bool) -> None:
        self.pool.set_draining(r)
        moving = 0
        if migrate:
            for req in list(r.inflight.values()):
                # One its client aborted, or one already moving (a tail flip): its Result settles it.
                # One that cannot go on elsewhere (structured output, n > 1) finishes here.
                if not req.client_aborted and not req.migrating and can_continue(req.msg):
                    self.migrate(req, r, "drain", req.msg.group)
                    moving += 1
        logger.info("draining replica %s: %d request(s) in flight, %d moving", r.replica_id, r.load, moving)
        self.drained()
        self.shutdown_if_idle(r)

    def shutdown_if_idle(self, r: Replica) -> None:
        """A draining replica that holds nothing is told to stop (again at each of its heartbeats:
        idempotent, and a Shutdown lost with a reconnect is repeated)."""
        if not r.draining or r.inflight:
            return
        if not r.shutdown_sent:
            r.shutdown_sent = True
            self.retired.add(r.replica_id)
            logger.info("replica %s is drained; shutting it down", r.replica_id)
        self.send(r.identity, P.Shutdown("drained"))

    def refuse_retired(self, ident: bytes, replica_id: str) -> bool:
        """A replica told to shut down that speaks again (a heartbeat in flight, a reconnect) is told
        again rather than welcomed back; True if ``replica_id`` is one."""
        if replica_id not in self.retired:
            return False
        self.send(ident, P.Shutdown("drained"))
        return True


class EmptyGroups:
    """Since when each target group has had no serving replica, and the requests that waited too long."""

    def __init__(self, rcfg: RouterConfig, groups: Collection[str], pool: ReplicaPool, queue: FairQueue,
                 tail: TailRouting, fail: Callable[[Request, str, str], None]) -> None:
        self.timeout = rcfg.no_replica_timeout_s
        self.keys: list[PoolKey] = [*groups, None] + ([BULK] if pool.reserved is not None else [])
        """Every target a request can wait for (None: any group)."""
        self.pool = pool
        self.queue = queue
        self.tail = tail
        self.fail = fail
        self.empty_since: dict[PoolKey, float] = {}

    def check(self, wall: float) -> None:
        """Note since when each target group (None: any group) has had no serving replica, and fail
        the queued requests that have waited ``no_replica_timeout_s`` for one."""
        for g in self.keys:
            if self.pool.members(g):
                self.empty_since.pop(g, None)
            else:
                self.empty_since.setdefault(g, wall)
        timeout = self.timeout
        if timeout is None or not self.queue.size:
            return
        expired = {g: t for g, t in self.empty_since.items() if wall - t >= timeout}
        if not expired:
            return
        # Only the buckets that can target an empty group: a request's bucket is the group it names;
        # the unnamed bucket targets any group, the bulk or the tail group (tail routing).
        scan: set[PoolKey] = set(expired)
        if self.tail.active and (self.tail.group in expired or BULK in expired):
            scan.add(None)
        doomed = []
        for req in self.queue.waiting_for(scan):
            g = self.tail.target(req)
            if g in expired and wall - max(req.t_submit, expired[g]) >= timeout:
                doomed.append((req, g))
        for req, g in doomed:
            self.queue.discard(req)
            where = "any group" if g is None else "any group but the tail group" if g == BULK else f"group {g}"
            self.fail(req, "no_replica", f"no ready replica in {where} for {wall - expired[g]:.0f}s")
        if doomed:
            logger.warning("%d request(s) failed: no ready replica for %.0fs", len(doomed), timeout)
