"""A replica as the router knows it: what it registered with, the requests it holds, what its last
heartbeat said. A plain record; each group of fields has one writer, named above it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from toolkit.core.names import place_of
from toolkit.core.protocol import Message, ReplicaStats
from toolkit.router.speed import SpeedMeter

if TYPE_CHECKING:
    from toolkit.router.queue import Request

Send = Callable[[bytes, Message], None]
"""Sends one message to a socket identity: a replica's on the router's backend, or a client's on its
frontend. The router's parts get one of these, never the sockets."""


@dataclass(eq=False)
class Replica:
    replica_id: str
    identity: bytes
    """Its socket's routing id on the router's backend."""
    group: str
    max_inflight: int
    max_model_len: int
    vocab_size: int
    model: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    streams: str = ""
    """How its engine takes streamed updates (``Register.streams``)."""
    stream_ranks: int = 1
    """Ranks its workers take in an update's chain."""
    kv_block_size: int = 0
    """Tokens per block of its engine's prefix cache, when it reports KV events (0: it does not)."""
    kv_capacity_tokens: int = 0
    """Tokens its engine's KV cache holds (0: unknown)."""

    # ---- written by the KV index (``kv_index.py``) ---------------------------------------------------
    kv_slot: int = -1
    """Its bit in the index's masks (-1: not indexed)."""

    # ---- written by the pool (``pool.py``): whether it serves, and what it holds -----------------
    ready: bool = False
    """Its readiness probe passed and it holds the run's weights (false again when its engine dies)."""
    draining: bool = False
    """Drained (``Drain``): out of dispatch, its in-flight requests finish or move; then ``Shutdown``."""
    inflight: dict[str, Request] = field(default_factory=dict)
    suspects: int = 0
    """Requests in flight here that were in flight at an engine death."""
    marked: int = 0
    """Requests in flight here with a length hint or a move behind them (not ``queue.plain``)."""

    # ---- written by membership (``membership.py``): liveness ---------------------------------------
    stats: ReplicaStats = field(default_factory=ReplicaStats)
    """What its last heartbeat said (all zero until the first)."""
    heartbeats: int = 0
    """Heartbeats received since it registered: its engine's counters are known only after the first."""
    last_seen: float = 0.0
    probe_sent_at: float = 0.0
    progress_at: float = 0.0
    """When it last showed progress: a token (here), else work starting or a weight load ending
    (:meth:`restart_stall_clock`). The stall clock."""
    speed: SpeedMeter = field(default_factory=SpeedMeter)
    """Its decode rate and the rate one running request gets, learned from heartbeats."""

    # ---- written by elastic scale-down (``elastic.py``) --------------------------------------------
    shutdown_sent: bool = False

    @property
    def place(self) -> str:
        """Its place in the fleet: its id before the ``@host:pid`` (``group-index``), the same for a restarted
        replica and for the twin's. What consistent hashing places it by, so that where a session goes does
        not depend on the pids a run got."""
        return place_of(self.replica_id)

    @property
    def serving(self) -> bool:
        """Takes new requests: ready and not draining."""
        return self.ready and not self.draining

    @property
    def load(self) -> int:
        return len(self.inflight)

    @property
    def has_room(self) -> bool:
        """A slot of its own is not taken (whether or not it serves)."""
        return len(self.inflight) < self.max_inflight

    def restart_stall_clock(self, now: float) -> None:
        """No token is owed before ``now``: work just began here, or a weight load paused generation."""
        self.progress_at = now
