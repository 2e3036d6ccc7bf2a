"""Elastic scale-down, the router's part: draining replicas out, and groups left with none.

``Drain`` takes a replica out of dispatch at once (its free slots, its group's members, capacity and
limits) but keeps it known, so its heartbeats and its in-flight requests' Results still count. With
``migrate`` those requests are aborted and continue elsewhere from where they stopped (the tail
migration's path, on the request's own group); without it they finish where they run. A draining
replica that holds nothing gets ``Shutdown`` and its process exits 0. Its id is then retired: a
heartbeat or a registration from it gets ``Shutdown`` again, never a welcome.

A group with no serving replica (scaled to zero, drained, dead) keeps its requests queued, and a
replica that joins later serves them. ``router.no_replica_timeout_s`` bounds that wait: a queued
request fails as ``no_replica`` once its target group has been empty, and it has waited, that long.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from toolkit.core import protocol as P
from toolkit.core.sockets import send_msg
from toolkit.router.migration import can_continue
from toolkit.router.pool import BULK
from toolkit.router.queue import FairQueue, Request

if TYPE_CHECKING:
    from toolkit.config import RouterConfig
    from toolkit.router.policy import Replica
    from toolkit.router.pool import ReplicaPool
    from toolkit.router.tail.routing import TailRouting

logger = logging.getLogger(__name__)


def replica_name(replica_id: str) -> str:
    """``<group>-<index>`` of a replica id ``<group>-<index>@<host>:<pid>``: what launch names."""
    return replica_id.partition("@")[0]


class ElasticMixin:
    """Part of :class:`toolkit.router.server.Router` (uses its sockets, replicas, queue and migration)."""

    # Provided by Router.
    backend: Any
    rcfg: RouterConfig
    replicas: dict[bytes, Replica]
    pool: ReplicaPool
    known_groups: set[str]
    queue: FairQueue
    tail: TailRouting
    retired: set[str]
    empty_since: dict[str | None, float]
    _start_migration: Callable[[Request, Replica, str, str | None], None]
    target_group: Callable[[Request], str | None]
    _fail: Callable[[Request, str, str], None]
    _answer_weights: Callable[[], None]

    def drain(self, names: list[str], migrate: bool) -> None:
        """Drain every live replica named in ``names`` (``<group>-<index>``)."""
        wanted = set(names)
        found: set[str] = set()
        for r in list(self.replicas.values()):
            name = replica_name(r.replica_id)
            if name in wanted:
                found.add(name)
                if not r.draining:  # else a resend: it is on its way out already
                    self._drain_one(r, migrate)
        for name in sorted(wanted - found):
            # Launch resends until the process is gone: it may have just gone, or not registered yet.
            logger.info("drain: no replica named %s here", name)

    def _drain_one(self, r: Replica, migrate: bool) -> None:
        self.pool.withdraw(r)
        r.draining = True
        moving = 0
        if migrate:
            for req in list(r.inflight.values()):
                assert isinstance(req, Request)
                # One its client aborted, or one already moving (a tail flip): its Result settles it.
                # One that cannot go on elsewhere (structured output, n > 1) finishes here.
                if not req.client_aborted and not req.migrating and can_continue(req.msg):
                    self._start_migration(req, r, "drain", req.msg.group)
                    moving += 1
        logger.info("draining replica %s: %d request(s) in flight, %d moving", r.replica_id, r.load, moving)
        self._answer_weights()  # a weight update no longer waits for it
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
        send_msg(self.backend, r.identity, P.Shutdown("drained"))

    def refuse_retired(self, ident: bytes, replica_id: str) -> bool:
        """A replica told to shut down that speaks again (a heartbeat in flight, a reconnect) is told
        again rather than welcomed back; True if ``replica_id`` is one."""
        if replica_id not in self.retired:
            return False
        send_msg(self.backend, ident, P.Shutdown("drained"))
        return True

    # ---- groups with no replica ------------------------------------------------------------
    def check_empty_groups(self, wall: float) -> None:
        """Note since when each target group (None: any group) has had no serving replica, and fail
        the queued requests that have waited ``no_replica_timeout_s`` for one."""
        keys: list[str | None] = [*self.known_groups, None]
        if self.pool.reserved is not None:
            keys.append(BULK)
        for g in keys:
            if self.pool.groups.get(g):
                self.empty_since.pop(g, None)
            else:
                self.empty_since.setdefault(g, wall)
        timeout = self.rcfg.no_replica_timeout_s
        if timeout is None or not self.queue.size:
            return
        expired = {g: t for g, t in self.empty_since.items() if wall - t >= timeout}
        if not expired:
            return
        # Only the buckets that can target an empty group: a request's bucket is the group it names;
        # the unnamed bucket targets any group, the bulk or the tail group (tail routing).
        scan: set[str | None] = set(expired)
        if self.tail.policy is not None and (self.tail.group in expired or BULK in expired):
            scan.add(None)
        doomed = []
        for req in self.queue.waiting_for(scan):
            g = self.target_group(req)
            if g in expired and wall - max(req.t_submit, expired[g]) >= timeout:
                doomed.append((req, g))
        for req, g in doomed:
            self.queue.discard(req)
            where = "any group" if g is None else "any group but the tail group" if g == BULK else f"group {g}"
            self._fail(req, "no_replica", f"no ready replica in {where} for {wall - expired[g]:.0f}s")
        if doomed:
            logger.warning("%d request(s) failed: no ready replica for %.0fs", len(doomed), timeout)
