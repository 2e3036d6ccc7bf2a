"""ZMQ sockets the way every component needs them."""

from __future__ import annotations

import zmq


def make_socket(ctx: zmq.Context, kind: int, routing_id: str | None = None) -> zmq.Socket:
    """A socket with ``linger`` 0 (closing never blocks on unsent frames) and no high-water mark:
    the router queues requests itself, so ZMQ must never drop or block on a frame."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id.encode())
    return s
