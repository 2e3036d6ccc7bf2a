"""How the router's messages leave it: to a replica (the backend) or to a client (the frontend).

:class:`ZmqLinks` is the process's: two ZMQ ROUTER sockets (CURVE on Slurm). The fleet twin
(``toolkit.plan``) gives the router links that deliver in virtual time instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import zmq

from toolkit.core import protocol as P
from toolkit.core.security import ServerCurve
from toolkit.core.sockets import advertised, make_socket, send_frames


class Links(ABC):
    @abstractmethod
    def to_replica(self, ident: bytes, *frames: bytes) -> None:
        """One message (its type frame and payload, or more frames) to replica ``ident``."""

    @abstractmethod
    def to_client(self, ident: bytes, *frames: bytes) -> None:
        """One message to client ``ident``."""

    def replica_msg(self, ident: bytes, msg: P.Message) -> None:
        self.to_replica(ident, *P.encode(msg))

    def client_msg(self, ident: bytes, msg: P.Message) -> None:
        self.to_client(ident, *P.encode(msg))

    def close(self) -> None:  # noqa: B027 - links with nothing to release
        """Release what the links hold."""


class ZmqLinks(Links):
    def __init__(self, ctx: zmq.Context, curve: ServerCurve | None) -> None:
        self.frontend = make_socket(ctx, zmq.ROUTER, curve=curve)
        self.backend = make_socket(ctx, zmq.ROUTER, curve=curve)

    def bind(self, host: str) -> tuple[str, str]:
        """Bind both sockets on ``host``; their advertised addresses (frontend, backend)."""
        self.frontend.bind(f"tcp://{host}:*")
        self.backend.bind(f"tcp://{host}:*")
        return (advertised(self.frontend.getsockopt_string(zmq.LAST_ENDPOINT)),
                advertised(self.backend.getsockopt_string(zmq.LAST_ENDPOINT)))

    def to_replica(self, ident: bytes, *frames: bytes) -> None:
        send_frames(self.backend, ident, *frames)

    def to_client(self, ident: bytes, *frames: bytes) -> None:
        send_frames(self.frontend, ident, *frames)

    def close(self) -> None:
        self.frontend.close(0)
        self.backend.close(0)
