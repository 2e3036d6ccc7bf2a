"""ZMQ sockets the way every component needs them, and the router's addresses."""

from __future__ import annotations

import asyncio
import logging
import random
import socket
from pathlib import Path
from typing import Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from toolkit.core import protocol as P
from toolkit.core.errors import RouterRefused, RouterUnavailable
from toolkit.core.rundir import read_json

logger = logging.getLogger(__name__)

# On hot paths pyzmq's send_multipart/recv_multipart (enum flags, copies) cost more than the socket
# calls themselves: the backend's send/recv/get with plain int flags.
_MORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_raw_send = zmq.backend.Socket.send
_raw_recv = zmq.backend.Socket.recv
_raw_get = zmq.backend.Socket.get


def send_frames(sock: zmq.Socket, *frames: bytes) -> None:
    """One multipart message (the router's hot path)."""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        _raw_send(sock, f, _MORE if i < last else 0)


def send_msg(sock: zmq.Socket, ident: bytes, msg: P.Message) -> None:
    """One message to the peer ``ident`` of a ROUTER socket."""
    send_frames(sock, ident, *P.encode(msg))


def recv_frames(sock: zmq.Socket) -> list[bytes]:
    """One whole multipart message without blocking, or zmq.Again."""
    frames = [_raw_recv(sock, _NOBLOCK)]
    while _raw_get(sock, _RCVMORE):
        frames.append(_raw_recv(sock, _NOBLOCK))
    return frames


class CurveSide(Protocol):
    """CURVE settings of one side (``toolkit.core.security.ServerCurve`` or ``ClientCurve``)."""

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


def own_bind_host(host: str | None, cluster_type: str) -> str:
    """Where a component other than the router listens (its ``/metrics``): ``router.host`` names the
    router's node, so it binds here only when it is loopback (everything on one machine); any other
    address binds every interface, which is this node's on whichever node the component landed."""
    if host is not None and host not in ("127.0.0.1", "localhost", "::1"):
        return "0.0.0.0"
    return bind_host(host, cluster_type)


def free_port() -> int:
    """A port the kernel has free on every interface now, for a server about to bind it."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def reserved_free_port(low: int = 10_000, tries: int = 200, rng: random.Random | None = None) -> int:
    """A port free on every interface now, drawn below the kernel's ephemeral range, for a server that
    binds it only later (another process's, a minute on): the kernel never hands a port of that range
    out itself (to a ``bind`` to port 0 or a ``connect``), so only a process naming it could take it
    meanwhile. A port from :func:`free_port` is in the range and free for anyone once released."""
    try:
        first = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32_768  # Linux's default
    rng = rng or random.Random()
    if first > low:
        for _ in range(tries):
            port = rng.randrange(low, first)
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
                return port
    return free_port()


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


_HANDSHAKES = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
               | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
UNEXPLAINED_FAILURES = 3
"""Handshakes in a row that failed with no reason given (a router whose public key is not the one in this
process's run dir closes the connection: ZMQ retries, and fails again) before the link counts as refused.
One alone may be a router that went away mid-handshake."""


def refusal(event: int, value: int, failures: int, curve: bool) -> str | None:
    """Why the router refused a link (``curve``: this side uses CURVE), from a handshake event of its
    socket monitor (``failures``: the unexplained ones in a row, this one counted); None if not refused."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the router did not admit this process's CURVE key (status {value}): the keys in the run dir "
                "are not the ones the router was started with (another run's, or written again since)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return ("this process uses CURVE (its run dir holds keys) and the router does not (router.curve=false)"
                if curve else "the router uses CURVE and this process has no keys (none in its run dir)")
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and failures >= UNEXPLAINED_FAILURES:
        return f"{failures} handshakes in a row failed with no reason given: " + (
            "the router's public key in the run dir is likely not this router's (another run's keys)" if curve
            else "this process has no keys (none in its run dir), and the router likely uses CURVE")
    return None


class RouterLink:
    """A DEALER to one of the router's two sockets (``side``: ``frontend`` or ``backend``) that
    follows the router to a new address when the address file changes (a restarted router). A router
    that refuses its handshake (:func:`refusal`) is an error of its next :meth:`recv` that times out."""

    def __init__(self, ctx: zmq.asyncio.Context, address_file: Path, side: str, curve: CurveSide | None = None,
                 routing_id: str | None = None) -> None:
        self.ctx = ctx
        self.address_file = address_file
        self.side = side
        self.curve = curve
        self.routing_id = routing_id
        self.sock: zmq.asyncio.Socket | None = None
        self.address = ""
        self._events: zmq.asyncio.Socket | None = None
        """The socket's monitor: its handshakes' outcomes, read only when a receive times out."""
        self._failures = 0

    def connect(self, address: str) -> None:
        self.close()
        s = make_socket(self.ctx, zmq.DEALER, self.routing_id, curve=self.curve)
        self._events = s.get_monitor_socket(_HANDSHAKES)  # type: ignore[assignment]
        self._failures = 0
        s.connect(address)
        self.sock = s  # type: ignore[assignment]
        self.address = address

    async def follow(self) -> bool:
        """Reconnect if the router has moved; True if it did. A file that cannot be read now (a shared
        file system's hiccup) leaves the link as it is until the next look: the caller is the task
        that reads the socket, and nothing would read it if this raised."""
        try:
            info = await asyncio.to_thread(read_json, self.address_file)
            address = info.get(self.side) if isinstance(info, dict) else None
        except (OSError, ValueError) as exc:
            logger.warning("could not read %s (%s); the link stays at %s", self.address_file, exc, self.address)
            return False
        if not isinstance(address, str) or not address or address == self.address:
            return False
        self.connect(address)
        return True

    @property
    def closed(self) -> bool:
        return self.sock is None

    def _open(self) -> zmq.asyncio.Socket:
        if self.sock is None:
            # Not connected yet, or closed by its owner while another task still used it.
            raise RouterUnavailable(f"the link to the router's {self.side} is closed")
        return self.sock

    async def send(self, frames: list[bytes]) -> None:
        await self._open().send_multipart(frames)

    async def recv(self, timeout_s: float) -> list[bytes] | None:
        """The next message, or None if none came within ``timeout_s``."""
        sock = self._open()
        if not await sock.poll(int(timeout_s * 1000)):  # POLLIN, the default
            await self._check_handshakes()
            return None
        return await sock.recv_multipart()

    async def _check_handshakes(self) -> None:
        """Raise :class:`RouterRefused` if the handshakes since the last look say the router refused."""
        events = self._events
        while events is not None and await events.poll(0):
            m = parse_monitor_message(await events.recv_multipart())
            event, value = m["event"], m["value"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._failures = 0
                continue
            self._failures += 1
            why = refusal(event, value, self._failures, self.curve is not None)
            if why is not None:
                raise RouterRefused(f"the router's {self.side} at {self.address} refused this process: {why}")

    def close(self) -> None:
        if self.sock is not None:
            self.sock.disable_monitor()
            self.sock.close(0)
            self.sock = None
        if self._events is not None:
            self._events.close(0)
            self._events = None
