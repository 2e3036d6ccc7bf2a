"""The rank's HTTP gateway: agents speak an LLM API, the rank speaks token ids to the router.

An aiohttp server inside the rank's event loop. Each session has its own base URL,
``http://host:port/sessions/<key>/v1`` (OpenAI SDKs; Anthropic SDKs take it without ``/v1``), so a
harness that only takes a base URL needs nothing else. Every call of a session becomes ``Generate``
messages with the session's id, job and step (affinity, fairness, tail routing and migration apply
as to any request); the answer's text is decoded from the engine's ids, and the session keeps the
ids themselves (``toolkit/gateway/session.py``).

Errors come back in the protocol's own error body: 400 malformed, 401 without the run's token (when
the router uses CURVE), 404 unknown or ended session, 413 body too long (a conversation past the context: 400, context_length_exceeded), 429 over the
rank's ``gateway.max_concurrent_requests`` (a session's calls count once) or a session's
``SESSION_CALLS``, 503/504 when the engines could not answer. Nothing a
client sends can raise out of a handler into the rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from jinja2 import TemplateError

from toolkit.client import RouterClient
from toolkit.config import Config
from toolkit.core.protocol import Generate, Result, Sampling, Structured
from toolkit.core.rundir import RunDir
from toolkit.core.security import gateway_token
from toolkit.gateway.chat import ChatTokenizer
from toolkit.gateway.protocols import PROTOCOLS
from toolkit.gateway.protocols.base import Protocol
from toolkit.gateway.session import GatewaySession
from toolkit.gateway.stream import Stream, answer
from toolkit.gateway.toolcalls import get_parser, parse_constrained_call, tool_call_schema
from toolkit.gateway.types import ChatRequest, ChatResult, Choice, GatewayError
from toolkit.session.requests import OpenStep

logger = logging.getLogger(__name__)
T = TypeVar("T")

_ENGINE_STATUS = {"client_error": 400, "timeout": 504}
OFFLOAD_BYTES = 256 << 10
"""A call whose body is larger renders and tokenizes in a thread, off the rank's event loop (a 32 MB
tool result takes seconds; the other sessions and their timeouts go on meanwhile)."""
SESSION_CALLS = 16
"""Calls one session may have running or waiting at once; more are answered 429. Its calls run one
at a time (a turn continues the last), so more only wait; ``n`` choices ride on one call."""


@dataclass
class Settings:
    """What the gateway needs of the run's config (``toolkit/config/sections.py`` ``GatewayConfig`` and friends)."""

    job: str
    model: str
    max_model_len: int
    max_tokens: int
    temperature: float
    top_p: float
    request_timeout_s: float
    tool_parser: str = "hermes"
    host: str = "127.0.0.1"
    advertise: str = "127.0.0.1"
    port: int = 0
    max_concurrent_requests: int = 1024
    max_body_bytes: int = 32 << 20
    keepalive_s: float = 15.0
    token: str | None = None


@dataclass
class Entry:
    """A live session: its state, its step's request log, and the requests it has in flight."""

    session: GatewaySession
    open: OpenStep
    """The rank's open step: the one the session's next call may land in, and its request log."""
    rid_prefix: str
    """Its calls' request ids start with it: the session id, and a restart's attempt after it."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    attempts: int = 0
    inflight: set[str] = field(default_factory=set)
    closed: bool = False
    calls: int = 0
    """Its calls running or waiting for the session (they run one at a time)."""
    started_step: int = 0
    """The step the session began in (its calls' rows in the request log name it)."""
    prompt_key: str = ""
    """Its prompt's key (``Generate.prompt_key``): GRPO siblings share it, which ``tail.policy=predict``
    and the step's per-prompt records use."""


def gateway_settings(cfg: Config, run_dir: RunDir, rank: int, max_model_len: int) -> Settings:
    """The gateway of rank ``rank``: bound like the router (loopback locally, every interface on a
    cluster, advertising the hostname), admitting only the run's token where the router uses CURVE."""
    g = cfg.gateway
    host = g.host or ("127.0.0.1" if cfg.cluster.type == "local" else "0.0.0.0")
    return Settings(
        job=cfg.job, model=str(cfg.engine.model), max_model_len=max_model_len, max_tokens=cfg.workload.max_tokens,
        temperature=cfg.workload.temperature, top_p=cfg.workload.top_p,
        request_timeout_s=cfg.rollout.request_timeout_s, tool_parser=g.tool_parser, host=host,
        advertise=socket.gethostname() if host == "0.0.0.0" else host, port=g.port + rank if g.port else 0,
        max_concurrent_requests=g.max_concurrent_requests, max_body_bytes=int(g.max_body_mb * (1 << 20)),
        keepalive_s=g.keepalive_s,
        token=gateway_token(run_dir.root),
    )


class Gateway:
    def __init__(self, settings: Settings, chat: ChatTokenizer, client: RouterClient) -> None:
        self.s = settings
        self.chat = chat
        self.client = client
        self.parser = get_parser(settings.tool_parser)
        self.sessions: dict[str, Entry] = {}
        self.inflight = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> str:
        app = web.Application(client_max_size=self.s.max_body_bytes, middlewares=[self._guard])
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/sessions/{key}/v1/models", self._models)
        app.router.add_post("/sessions/{key}/reward", self._reward)
        app.router.add_get("/health", self._health)
        for proto in PROTOCOLS.values():
            app.router.add_post(f"/sessions/{{key}}/v1/{proto.route}", self._handler(proto))
        # handler_cancellation: a caller that disconnects cancels its call (Gateway.turn aborts it).
        # shutdown_timeout: at the rank's end, calls still waiting (on a router that is gone, say) are
        # cancelled after 5 s rather than aiohttp's 60.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True,
                                     shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.s.host, self.s.port, reuse_address=False, backlog=4096)
        await site.start()
        sock: socket.socket = site._server.sockets[0]  # type: ignore[union-attr]
        self.url = f"http://{self.s.advertise}:{sock.getsockname()[1]}"
        logger.info("gateway serving %s", self.url)
        return self.url

    async def close(self) -> None:
        for key in list(self.sessions):
            await self.close_session(key)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open_session(self, open_step: OpenStep, index: int, session_id: str, record_messages: bool = False,
                     attempt: int = 0, step: int | None = None) -> tuple[str, GatewaySession]:
        """Session ``index`` of step ``step`` (None: the open step; ``attempt`` > 0: a restart of one, whose
        calls need request ids of their own)."""
        step = open_step.step if step is None else step
        key = f"{step}-{index}-{secrets.token_hex(4)}"
        sess = GatewaySession(index, session_id, self.chat, record_messages)
        self.sessions[key] = Entry(sess, open_step, f"{session_id}~{attempt}" if attempt else session_id,
                                   started_step=step)
        return key, sess

    def set_prompt_key(self, key: str, prompt_key: str) -> None:
        """The session's prompt key, which its calls carry (before its agent starts)."""
        self.sessions[key].prompt_key = prompt_key

    async def close_session(self, key: str) -> None:
        """End a session: later calls get 404, and what it still has in the engines is aborted."""
        entry = self.sessions.pop(key, None)
        if entry is None:
            return
        entry.closed = True
        for rid in list(entry.inflight):
            await self.client.abort(rid)

    def base_url(self, key: str) -> str:
        return f"{self.url}/sessions/{key}/v1"

    # ---- HTTP --------------------------------------------------------------------------------
    @staticmethod
    def _protocol_of(path: str) -> Protocol:
        for proto in PROTOCOLS.values():
            if path.endswith("/" + proto.route):
                return proto
        return PROTOCOLS["chat"]

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Only the run's token gets in; no exception leaves a handler as anything but an answer."""
        proto = self._protocol_of(request.path)
        token = self.s.token
        if token is not None:
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
            # Headers arrive surrogate-escaped: a key with bytes outside UTF-8 is a wrong key, not a 500.
            if not secrets.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode()):
                return _error(proto, GatewayError(401, "a valid API key is required (the run's gateway token)"))
        try:
            return await handler(request)
        except web.HTTPException as exc:
            return _error(proto, GatewayError(exc.status, exc.reason or "error"))
        except GatewayError as exc:
            return _error(proto, exc)
        except Exception as exc:  # a bug of ours: the caller gets a 500, the rank goes on
            logger.exception("gateway error on %s", request.path)
            return _error(proto, GatewayError(500, f"internal error: {type(exc).__name__}: {exc}"))

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.s.model, "object": "model", "created": 0, "owned_by": "rollout-toolkit"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "sessions": len(self.sessions), "inflight": self.inflight})

    def _entry(self, request: web.Request) -> Entry:
        entry = self.sessions.get(request.match_info["key"])
        if entry is None:
            raise GatewayError(404, f"no live session {request.match_info['key']!r} on this gateway (it ended, "
                                    "or never existed)")
        return entry

    async def _body(self, request: web.Request) -> Any:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise GatewayError(413, f"request body over gateway.max_body_mb ({self.s.max_body_bytes >> 20} MB)") from None
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise GatewayError(400, f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise GatewayError(400, "the request body's JSON is nested too deeply") from None

    async def _reward(self, request: web.Request) -> web.Response:
        entry = self._entry(request)
        body = await self._body(request)
        value = body.get("reward") if isinstance(body, dict) else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise GatewayError(400, 'expected {"reward": <number>} (and "choice": <index> after an n > 1 call)',
                               "reward")
        choice = body.get("choice")
        if choice is not None:
            if isinstance(choice, bool) or not isinstance(choice, int):
                raise GatewayError(400, '"choice" is the index of one of the last call\'s n choices', "choice")
            async with entry.lock:  # not while a call of the session changes its lines
                try:
                    entry.session.choose(choice)
                except ValueError as exc:
                    raise GatewayError(400, str(exc), "choice") from None
        entry.session.reward = float(value)
        return web.json_response({"ok": True})

    def _handler(self, proto: Protocol) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            entry = self._entry(request)
            # A session's calls run one at a time, so they take one of the rank's places between them:
            # a session that fires many at once (or sends a body slowly) waits on itself, not on others.
            if entry.calls >= SESSION_CALLS:
                raise GatewayError(429, f"this session has {entry.calls} calls running or waiting (they run one "
                                        f"at a time, at most {SESSION_CALLS}); retry later")
            if not entry.calls:
                if self.inflight >= self.s.max_concurrent_requests:
                    raise GatewayError(429, f"this rank's gateway is serving gateway.max_concurrent_requests = "
                                            f"{self.s.max_concurrent_requests} sessions' calls; retry later")
                self.inflight += 1
            entry.calls += 1
            stream = Stream(request, self.s.keepalive_s)
            try:
                try:
                    req = proto.request(await self._body(request))
                except RecursionError:  # a field re-read nested past Python's limit
                    raise GatewayError(400, "the request's JSON is nested too deeply") from None
                if req.stream:
                    stream.start()
                written: list[web.StreamResponse] = []

                async def deliver(result: ChatResult) -> bool:
                    # What the turn spent in the router and engines: the rest of a call's time is the
                    # gateway's (not sent on a stream that began before the turn ended: its headers were gone).
                    await stream.stop()
                    resp, whole = await answer(request, proto, req, result,
                                               {"x-toolkit-generate-ms": f"{result.generate_s * 1000:.3f}"},
                                               stream.resp)
                    written.append(resp)
                    return whole

                # The body as read (a chunked upload has no Content-Length); aiohttp keeps it.
                await self.turn(entry, req, offload=len(await request.read()) > OFFLOAD_BYTES, deliver=deliver)
            except Exception as exc:
                if stream.resp is None:
                    raise  # the middleware answers it with its status
                if not isinstance(exc, GatewayError):
                    logger.exception("gateway error on %s", request.path)
                    exc = GatewayError(500, f"internal error: {type(exc).__name__}: {exc}")
                return await stream.fail(proto, exc)
            finally:
                # Before any await: a caller gone now cancels the handler there, and a place left taken
                # would be the rank's for the rest of the run.
                entry.calls -= 1
                if not entry.calls:
                    self.inflight -= 1
                await stream.stop()
            return written[0]
        return handle

    # ---- one turn ----------------------------------------------------------------------------
    def _constraint(self, req: ChatRequest) -> tuple[Structured | None, bool]:
        """The engine constraint a request asks for, and whether its output is a bare tool call."""
        choice = req.tool_choice
        if req.tools and (choice == "required" or isinstance(choice, dict)):
            name = choice.get("name") if isinstance(choice, dict) else None
            return Structured(json_schema=json.dumps(tool_call_schema(req.tools, name))), True
        fmt = req.response_format
        if fmt and fmt.get("type") == "json_schema":
            return Structured(json_schema=json.dumps(fmt.get("schema") or {})), False
        if fmt and fmt.get("type") == "json_object":
            return Structured(json_schema='{"type": "object"}'), False
        return None, False

    async def turn(self, entry: Entry, req: ChatRequest, offload: bool = False,
                   deliver: Callable[[ChatResult], Awaitable[bool]] | None = None) -> ChatResult:
        """Generate one answer for a session (its calls are taken one at a time, in order). ``offload``:
        render and tokenize in a thread (a big body would hold every session of the rank meanwhile).
        ``deliver``: writes the answer to the caller, True if it went out whole. The session records the
        turn only then: a caller gone before its answer retries the call on the session as it was (a
        retry of a turn it never saw would otherwise start a branch)."""
        s = self.s
        async with entry.lock:
            if entry.closed:  # ended while this call waited for the session
                raise GatewayError(404, "the session ended")
            sess = entry.session
            try:
                plan = await _in_thread(sess.plan, req.messages, req.tools) if offload else sess.plan(req.messages, req.tools)
            except TemplateError as exc:
                raise GatewayError(400, f"the model's chat template refused the conversation: {exc}") from None
            except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
                # The template read a field of the caller's that is not what it expects (a tool schema's
                # properties as a list, arguments nested past Python's limit): the caller's error.
                logger.info("a conversation the chat template could not render", exc_info=True)
                raise GatewayError(400, f"the model's chat template could not render the conversation: "
                                        f"{type(exc).__name__}: {exc}") from None
            if entry.closed:  # ended while the thread planned: nothing may reach the engines for it now
                raise GatewayError(404, "the session ended")
            budget = min(req.max_tokens or s.max_tokens, s.max_model_len - len(plan.prompt))
            if budget < 1:  # worded and coded as the APIs do, so that a harness that shortens its history does
                raise GatewayError(400, f"prompt is too long: {len(plan.prompt)} tokens > {s.max_model_len - 1} "
                                        f"maximum (the model's maximum context length is {s.max_model_len} tokens, "
                                        "and at least one must be generated)", "messages", "context_length_exceeded")
            structured, bare_call = self._constraint(req)
            entry.attempts += 1
            temperature = s.temperature if req.temperature is None else req.temperature
            top_p = s.top_p if req.top_p is None else req.top_p
            # Choices 2..n sample apart: from the request's seed, or from a fresh random one.
            base = req.seed if req.seed is not None else secrets.randbits(31)
            seeds = [req.seed] + [base + k for k in range(1, req.n)]
            gens = [Generate(
                request_id=f"{entry.rid_prefix}/{entry.attempts}" + (f"/{k}" if k else ""), job=s.job,
                session_id=sess.session_id, step=entry.open.step, prompt_token_ids=plan.prompt,
                sampling=Sampling(budget, temperature, top_p, seeds[k], True, structured=structured),
                deadline=time.time() + s.request_timeout_s,
                expected_tokens=req.expected_tokens, prompt_key=entry.prompt_key,
            ) for k in range(req.n)]
            entry.inflight.update(g.request_id for g in gens)
            sent = time.time()
            try:
                outs = await asyncio.gather(*(self.client.generate(g) for g in gens))
            except asyncio.CancelledError:
                # The caller went away (its client timed out; aiohttp cancels the handler): the answer
                # is nobody's, so the engines stop at once and the session records nothing of the call
                # (an SDK's retry then continues the session as it was, not as a branch).
                for g in gens:
                    await self.client.abort(g.request_id)
                raise
            finally:
                entry.inflight.difference_update(g.request_id for g in gens)
            done = time.time()
            for res, route in outs:
                entry.open.log.add(res, route, len(plan.prompt), sent, done, entry.session.index, entry.started_step)
                entry.open.answered(sess.session_id, res)
            if entry.closed:
                raise GatewayError(404, "the session ended while this call ran")
            for res, _ in outs:
                if res.status != "ok":
                    raise GatewayError(_ENGINE_STATUS.get(res.status, 503), f"engine: {res.status}: {res.error}")
            results = [r for r, _ in outs]
            choices = [self._choice(k, r, req, bare_call) for k, r in enumerate(results)]
            result = ChatResult(id=secrets.token_hex(12), model=req.model or s.model, created=int(sent),
                                choices=choices, prompt_tokens=len(plan.prompt),
                                completion_tokens=sum(len(c.token_ids) for c in choices),
                                cached_tokens=results[0].cached_tokens, generate_s=done - sent)
            if deliver is None or await deliver(result):
                sess.commit(plan, req.messages, results, choices)
            else:
                logger.info("session %s: its call's answer did not reach the caller; the turn is not recorded",
                            sess.session_id)
        return result

    def _choice(self, k: int, res: Result, req: ChatRequest, bare_call: bool) -> Choice:
        ids = res.output_token_ids
        text = self.chat.content_text(ids)
        calls = []
        if bare_call:
            call = parse_constrained_call(text)
            content, calls = ("", [call]) if call is not None else (text, [])
        elif req.tools and req.tool_choice != "none":
            content, calls = self.parser.parse(text)
        else:
            content = text
        if not req.parallel_tool_calls:
            calls = calls[:1]  # the harness asked for one: it echoes that one, and the session's line goes on
        finish = res.finish_reason if res.finish_reason in ("stop", "length") else "stop"
        if calls and finish == "stop":
            finish = "tool_calls"
        tokens_text, tokens_bytes = self.chat.token_pieces(ids) if req.logprobs else ([], [])
        return Choice(k, content, calls, finish, list(ids), list(res.logprobs), tokens_text, tokens_bytes)


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread, awaited to its end even when the caller is cancelled meanwhile: it
    works on a session whose lock the caller holds, and must not run on once the lock is released."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():  # a second cancel (aiohttp's shutdown) must not end the wait either
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({fut})
        raise


def _error(proto: Protocol, err: GatewayError) -> web.Response:
    headers = {"retry-after": "1"} if err.status in (429, 503) else None
    return web.json_response(proto.error_body(err), status=err.status, headers=headers)
