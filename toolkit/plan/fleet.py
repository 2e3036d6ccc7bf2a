"""The twin's fleet around the router's own object: replicas of :class:`TwinEngine` that register,
beat and answer as replica processes do, rank clients that speak as ``RouterClient`` does, and the
links between them, which deliver each message as a callback of the virtual-time loop.

Every message is encoded as in a real run. The router decodes what it gets, as it does in its process,
but a rank's Generate, which it takes as the rank's own object with its payload (``Router.submit``, what
``on_frontend`` calls with the message it decodes). A message the router passes on unchanged (a rank's
Generate to its replica, a replica's Result to its rank) reaches the twin's other end as the object that
was encoded, not decoded again (:meth:`Wire.keep`): the values are the same, and decoding a turn's whole
context again would cost the twin more than its router's choices do."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import msgspec

from toolkit.config import Config, SimEngineConfig, kv_events_on
from toolkit.core import protocol as P
from toolkit.core.names import replica_id
from toolkit.engine.kv_events import KvEventLog
from toolkit.engine.plans import plan_output
from toolkit.plan.engine import MovedPlans, Plan, TwinEngine
from toolkit.plan.loop import VirtualLoop
from toolkit.router.links import Links
from toolkit.router.membership import PROBE_PREFIX
from toolkit.router.server import Router

_T_RESULT = P.TYPE_OF[P.Result]
_T_GENERATE = P.TYPE_OF[P.Generate]
_dec_generate = P.DECODERS[_T_GENERATE]
_dec_result = P.DECODERS[_T_RESULT]
_dec_route = msgspec.msgpack.Decoder(P.Route)
_enc = msgspec.msgpack.Encoder()


class Wire(Links):
    """The router's links in the twin, and the way in to the router: every message is a callback on the
    loop after ``latency_s`` (0: the next turn of the loop), and the router dispatches after each
    turn that brought it messages, as its own loop does after a drain."""

    def __init__(self, loop: VirtualLoop, latency_s: float) -> None:
        self.loop = loop
        self.router: Router | None = None
        self.replicas: dict[bytes, TwinReplica] = {}
        self.clients: dict[bytes, TwinClient] = {}
        self._dispatch_due = False
        self._kept: dict[int, tuple[bytes, Any]] = {}
        """``id(payload)`` -> (the payload, the message it encodes), for the end it is passed on to."""
        self._of: dict[str, list[int]] = {}
        """Request id -> the keys kept for it."""
        self._deliver: Callable[..., Any] = (functools.partial(loop.later, latency_s) if latency_s > 0
                                             else loop.soon)
        """``_deliver(fn, *args)``: ``fn(*args)`` on the loop, ``latency_s`` later (0: its next turn)."""

    def keep(self, request_id: str, payload: bytes, msg: Any) -> None:
        """``payload`` encodes ``msg`` (of ``request_id``): whoever receives this very payload may take
        ``msg`` (:meth:`take`). The entry holds the payload, so no other object has its id while it is kept."""
        self._kept[id(payload)] = (payload, msg)
        self._of.setdefault(request_id, []).append(id(payload))

    def take(self, payload: bytes) -> Any:
        """The message kept for ``payload`` (gone from the keep), or None: it is decoded then."""
        kept = self._kept.pop(id(payload), None)
        return kept[1] if kept is not None else None

    def settle(self, request_id: str) -> None:
        """``request_id`` has its answer: what was kept for it and not passed on (not dispatched, a moved
        leg's Result that the router merged) goes. A key taken meanwhile and reused can only cost a decode."""
        for key in self._of.pop(request_id, ()):
            self._kept.pop(key, None)

    # the router's side
    def to_replica(self, ident: bytes, *frames: bytes) -> None:
        r = self.replicas.get(ident)
        if r is not None:
            self._deliver(r.receive, frames)

    def to_client(self, ident: bytes, *frames: bytes) -> None:
        c = self.clients.get(ident)
        if c is not None:
            self._deliver(c.receive, frames)

    # the way in
    def from_replica(self, ident: bytes, mtype: bytes, payload: bytes, *more: bytes) -> None:
        self._deliver(self._in, True, ident, mtype, payload, *more)

    def from_client(self, ident: bytes, mtype: bytes, payload: bytes) -> None:
        self._deliver(self._in, False, ident, mtype, payload)

    def _in(self, backend: bool, ident: bytes, mtype: bytes, payload: bytes, *more: bytes) -> None:
        assert self.router is not None
        kept = self._kept.get(id(payload)) if not backend and mtype == _T_GENERATE else None
        if backend:
            self.router.on_backend(ident, mtype, payload, *more)
        elif kept is not None:  # a rank's Generate: what on_frontend would decode
            self.router.submit(ident, kept[1], payload)
        else:
            self.router.on_frontend(ident, mtype, payload, *more)
        if not self._dispatch_due:
            self._dispatch_due = True
            self.loop.soon(self._dispatch)

    def _dispatch(self) -> None:
        self._dispatch_due = False
        assert self.router is not None
        self.router.dispatch()

    def start_timers(self, heartbeat_s: float) -> None:
        """The router's own timers: its sweep, and tail routing's moves while it is on."""
        assert self.router is not None
        router = self.router
        sweep_every = min(heartbeat_s / 2, 0.25)

        def sweep() -> None:
            router.sweep()
            router.dispatch()
            self.loop.later(sweep_every, sweep)

        def move() -> None:
            router.move_long_runners()
            router.dispatch()
            self.loop.later(router.tail.tick_s(), move)

        self.loop.later(sweep_every, sweep)
        if router.tail.active:
            self.loop.later(router.tail.tick_s(), move)


class TwinReplica:
    """A replica of the twin: registers, beats every ``router.heartbeat_s`` and serves what the router
    sends, with its engine stepping in virtual time. :meth:`die` stops it dead (a lost node)."""

    def __init__(self, cfg: Config, group: str, index: int, engine: SimEngineConfig, wire: Wire,
                 plan: Plan | MovedPlans = plan_output) -> None:
        self.cfg = cfg
        self.group = group
        self.replica_id = replica_id(group, index, "twin")
        self.ident = self.replica_id.encode()
        self.ecfg = engine
        self.wire = wire
        self.engine = TwinEngine(engine, wire.loop, self._answer, plan)
        self.kv: KvEventLog | None = None
        if kv_events_on(cfg):  # as a replica process: its cache's events go to the router
            self.kv = self.engine.cache.log = KvEventLog()
        self.alive = False
        self._beat: asyncio.TimerHandle | None = None
        wire.replicas[self.ident] = self

    def start(self) -> None:
        self.alive = True
        self._register()
        self._beat = self.wire.loop.later(self.cfg.router.heartbeat_s, self._heartbeat)

    def _send(self, msg: P.Message) -> None:
        if self.alive:
            self.wire.from_replica(self.ident, *P.encode(msg))

    def _register(self) -> None:
        g = self.cfg.groups[self.group]
        self._send(P.Register(replica_id=self.replica_id, group=self.group, labels={"group": self.group, **g.labels},
                              model=self.ecfg.model, max_inflight=g.max_inflight,
                              max_model_len=self.ecfg.max_model_len, vocab_size=self.ecfg.vocab_size,
                              streams="model", kv_block_size=self.ecfg.block_size if self.kv is not None else 0,
                              kv_capacity_tokens=self.ecfg.kv_cache_tokens))

    def _send_kv(self) -> None:
        batch = self.kv.take() if self.kv is not None else None
        if batch is not None:
            self._send(batch)

    def _heartbeat(self) -> None:
        if not self.alive:
            return
        self._send_kv()
        self._send(P.Heartbeat(self.replica_id, self.engine.stats(), self.kv.seq if self.kv is not None else 0))
        self._beat = self.wire.loop.later(self.cfg.router.heartbeat_s, self._heartbeat)

    def _answer(self, res: P.Result) -> None:
        if self.alive:  # the KV events since the last batch ride in the Result's message, as a replica's do
            res.replica_id, res.group = self.replica_id, self.group  # stamped as a replica stamps them
            kv = self.kv.frames() if self.kv is not None else ()
            payload = _enc.encode(res)
            if not res.request_id.startswith(PROBE_PREFIX):  # the router's own probe is not passed on
                self.wire.keep(res.request_id, payload, res)
            self.wire.from_replica(self.ident, _T_RESULT, payload, *kv)

    def receive(self, frames: tuple[bytes, ...]) -> None:
        if not self.alive:
            return
        mtype, payload = frames[0], frames[1]
        if mtype == _T_GENERATE:
            self.engine.submit(self.wire.take(payload) or _dec_generate.decode(payload))
            return
        msg = P.decode(mtype, payload)
        if isinstance(msg, P.Abort):
            self.engine.abort(msg.request_id)
        elif isinstance(msg, P.Reregister):
            self._register()
        elif isinstance(msg, P.KvResync) and self.kv is not None:
            self._send(self.kv.snapshot(list(self.engine.cache.blocks)))
        elif isinstance(msg, P.Shutdown):
            self.die()
        else:
            raise NotImplementedError(f"the twin's replicas take no {type(msg).__name__} (weights are not modelled)")

    def die(self) -> None:
        """Gone at once, with what it ran: no answer, no heartbeat (the router finds out by their absence)."""
        self.alive = False
        if self._beat is not None:
            self._beat.cancel()
        self.engine.halt()


class TwinClient:
    """A rank's ``RouterClient`` in the twin: the calls its sessions and closers make."""

    def __init__(self, rank: int, wire: Wire) -> None:
        self.ident = f"rank-{rank}".encode()
        self.wire = wire
        self.pending: dict[str, asyncio.Future[tuple[P.Result, P.Route | None]]] = {}
        self.acks: dict[tuple[str, int], asyncio.Future[None]] = {}
        wire.clients[self.ident] = self

    def _send(self, msg: P.Message) -> None:
        self.wire.from_client(self.ident, *P.encode(msg))

    async def generate(self, msg: P.Generate) -> tuple[P.Result, P.Route | None]:
        fut: asyncio.Future[tuple[P.Result, P.Route | None]] = self.wire.loop.create_future()
        self.pending[msg.request_id] = fut
        mtype, payload = P.encode(msg)
        self.wire.keep(msg.request_id, payload, msg)
        self.wire.from_client(self.ident, mtype, payload)
        try:
            return await fut
        finally:
            self.pending.pop(msg.request_id, None)
            self.wire.settle(msg.request_id)

    async def abort(self, request_id: str) -> None:
        self._send(P.Abort(request_id))

    async def session_done(self, job: str, step: int, session_id: str) -> None:
        self._send(P.SessionDone(job, step, session_id))

    async def step_begin(self, job: str, step: int, n_sessions: int) -> None:
        fut: asyncio.Future[None] = self.wire.loop.create_future()
        self.acks[(job, step)] = fut
        self._send(P.StepBegin(job, step, n_sessions))
        await fut

    def receive(self, frames: tuple[bytes, ...]) -> None:
        if frames[0] == _T_RESULT:
            res = self.wire.take(frames[1]) or _dec_result.decode(frames[1])
            route = _dec_route.decode(frames[2]) if len(frames) > 2 else None
            fut = self.pending.get(res.request_id)
            if fut is not None and not fut.done():
                fut.set_result((res, route))
            return
        msg = P.decode(frames[0], frames[1])
        if isinstance(msg, P.StepBegin):
            ack = self.acks.pop((msg.job, msg.step), None)
            if ack is not None and not ack.done():
                ack.set_result(None)
