"""ZMQ sockets the way every component needs them, and the router's addresses."""

from __future__ import annotations

import logging
import socket
from typing import Protocol

import zmq

logger = logging.getLogger(__name__)


class CurveSide(Protocol):
    """CURVE settings of one side (``toolkit.security.ServerCurve`` or ``ClientCurve``)."""

    def apply(self, sock: zmq.Socket) -> None: ...


def make_socket(ctx: zmq.Context, kind: int, routing_id: str | None = None,
                curve: CurveSide | None = None) -> zmq.Socket:
    """A socket with ``linger`` 0 (closing never blocks on unsent frames) and no high-water mark:
    the router queues requests itself, so ZMQ must never drop or block on a frame. With ``curve``
    the socket is encrypted and authenticated (set before bind/connect, as ZMQ requires)."""
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    if routing_id is not None:
        s.setsockopt(zmq.ROUTING_ID, routing_id.encode())
    if curve is not None:
        curve.apply(s)
    return s


def bind_host(host: str | None, cluster_type: str) -> str:
    """``router.host``, or by default: loopback for a local run, every interface on a cluster
    (replicas and ranks connect from other nodes)."""
    if host is not None:
        return host
    return "127.0.0.1" if cluster_type == "local" else "0.0.0.0"


def node_address() -> str:
    """This node's name as other nodes reach it: the hostname if it resolves, else the address of
    the interface that routes outwards."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, it only picks a route
            return str(s.getsockname()[0])
        except OSError:
            logger.warning("no routable address found for %s; advertising 127.0.0.1", name)
            return "127.0.0.1"


def advertised(endpoint: str) -> str:
    """The endpoint to write into router.json: a wildcard bind becomes this node's address."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{node_address()}:{endpoint[len(wildcard):]}"
    return endpoint
