"""A call's HTTP answer: one JSON body, or server-sent events when it streams.

A streaming call's turn is generated whole (the engines answer with all of a turn's tokens at once),
so its frames are written when the turn ends. A turn can outlast a client's idle timeout between
bytes (the OpenAI and Anthropic SDKs wait 600 s; many harnesses less), so a stream whose turn runs
longer than ``gateway.keepalive_s`` starts at once with ``200`` and an SSE comment every
``keepalive_s`` (every SSE parser skips comment lines). Until then an error is still an HTTP status;
after, it is the stream's ``error`` event, which both SDKs raise as an API error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec
from aiohttp import web

from toolkit.gateway.protocols import SSE_CONTENT_TYPE
from toolkit.gateway.protocols.base import Protocol, sse
from toolkit.gateway.types import ChatRequest, ChatResult, GatewayError

logger = logging.getLogger(__name__)

KEEPALIVE = b": keepalive\n\n"
_SSE_HEADERS = {"content-type": SSE_CONTENT_TYPE, "cache-control": "no-cache"}


class Stream:
    """A streaming call's response, started by its keepalive (:meth:`start`) only once its turn outlasts
    ``keepalive_s``."""

    def __init__(self, request: web.Request, keepalive_s: float) -> None:
        self.request = request
        self.keepalive_s = keepalive_s
        self.resp: web.StreamResponse | None = None
        self._keep: asyncio.Task[None] | None = None

    def start(self) -> None:
        """The turn begins: keep the connection alive beside it."""
        self._keep = asyncio.create_task(self._keep_alive(), name="keepalive")

    async def stop(self) -> None:
        """The turn ended: no keepalive may follow (nor land after the answer's last frame)."""
        if self._keep is not None:
            self._keep.cancel()
            await asyncio.gather(self._keep, return_exceptions=True)
            self._keep = None

    async def _keep_alive(self) -> None:
        with contextlib.suppress(ConnectionResetError):  # gone: aiohttp cancels the call itself
            while True:
                await asyncio.sleep(self.keepalive_s)
                if self.resp is None:
                    self.resp = web.StreamResponse(headers=_SSE_HEADERS)
                    await self.resp.prepare(self.request)
                await self.resp.write(KEEPALIVE)

    async def fail(self, proto: Protocol, err: GatewayError) -> web.StreamResponse:
        """``err`` on a stream already started: the protocol's error body as an ``error`` event."""
        assert self.resp is not None
        await self.stop()
        with contextlib.suppress(ConnectionResetError):
            await self.resp.write(sse(proto.error_body(err), event="error"))
            await self.resp.write_eof()
        return self.resp


async def answer(request: web.Request, proto: Protocol, req: ChatRequest, result: ChatResult,
                 headers: dict[str, str] | None = None, started: web.StreamResponse | None = None
                 ) -> tuple[web.StreamResponse, bool]:
    """The protocol's answer, written now: one JSON body, or its server-sent events when the call streams
    (on ``started``, the stream :class:`Stream` began, whose headers are sent already); and whether it
    went out whole (False: the client was gone)."""
    if not req.stream:
        resp: web.StreamResponse = web.json_response(proto.respond(req, result), dumps=_dumps, headers=headers)
        frames: list[bytes] = []
    else:
        resp = started or web.StreamResponse(headers={**_SSE_HEADERS, **(headers or {})})
        frames = list(proto.stream(req, result))
    try:
        if not resp.prepared:
            await resp.prepare(request)
        for frame in frames:
            await resp.write(frame)
        await resp.write_eof()
    except ConnectionResetError:
        logger.info("a client went away before its answer was written (%s)", request.path)
        return resp, False
    return resp, True


def _dumps(obj: Any) -> str:
    return msgspec.json.encode(obj).decode()
