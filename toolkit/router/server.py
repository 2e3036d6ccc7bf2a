"""The router process: a ZMQ ROUTER for clients (frontend) and one for replicas (backend).

:class:`Router` owns the sockets, the message switch and each request's life (submit, dispatch,
complete); it is composed of parts that get what they need in their constructors: the replicas and
their slots (``pool.py``), membership, weights, elastic scale-down, migrations and tail routing. Requests
wait here, not in engines, and exactly one Result goes back per request id.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from collections.abc import Callable

import msgspec
import zmq

from toolkit.config import Affinity, Config, curve_enabled, moves_carry_kv
from toolkit.core import clock
from toolkit.core import protocol as P
from toolkit.core.metrics import Endpoint
from toolkit.core.rundir import FileWriter, RunDir, atomic_write
from toolkit.core.security import server_curve
from toolkit.core.sockets import recv_frames
from toolkit.router.answered import Answered
from toolkit.router.deadlines import Deadlines
from toolkit.router.elastic import Elastic, EmptyGroups
from toolkit.router.kv import KvRouting
from toolkit.router.links import Links, ZmqLinks
from toolkit.router.membership import PROBE_PREFIX, Membership
from toolkit.router.metrics import DecisionTimer, RouterMetrics
from toolkit.router.migration import Migrations
from toolkit.router.pool import ReplicaPool, limit_error
from toolkit.router.queue import FairQueue, Request
from toolkit.router.replica import Replica
from toolkit.router.tail.routing import TailRouting, reserved_group
from toolkit.router.timeline import Timeline
from toolkit.router.weights import WeightSync

logger = logging.getLogger(__name__)

# Messages taken from one socket before dispatching: small batches keep the pipeline to the
# replicas and back to the clients flowing instead of moving in bursts.
_DRAIN = 128
AFFINITY_SCAN = 64
"""With ``router.affinity=wait``: requests of a job's bucket tried, from its head, for one with a place."""
_T_GENERATE = P.TYPE_OF[P.Generate]
_T_RESULT = P.TYPE_OF[P.Result]
_dec_generate = P.DECODERS[_T_GENERATE]
_dec_head = msgspec.msgpack.Decoder(P.ResultHead)
_dec_kv = P.DECODERS[P.TYPE_OF[P.KvEvents]]
_enc = P._encoder


class Router:
    def __init__(self, cfg: Config, run_dir: RunDir, ctx: zmq.Context | None = None,
                 links: Links | None = None) -> None:
        """``links``: where its messages go; by default two ZMQ sockets of ``ctx`` (see :meth:`bind`)."""
        self.cfg = cfg
        self.rcfg = cfg.router
        self.run_dir = run_dir
        self.curve = None
        if links is None:
            # CURVE (router.curve): encrypted sockets that admit only the run's own replicas and ranks.
            ctx = ctx or zmq.Context.instance()
            self.curve = server_curve(curve_enabled(cfg), ctx, run_dir.root)
            links = ZmqLinks(ctx, self.curve)
        self.links = links
        self.groups = frozenset(cfg.groups)
        # Each request's life: waiting, live (queued or running), answered.
        self.queue = FairQueue(AFFINITY_SCAN if cfg.router.affinity == Affinity.wait else 1)
        self.live: dict[str, Request] = {}
        self.answered = Answered(cfg.router.result_cache, int(cfg.router.result_cache_mb * 2**20))
        self.stats: Counter[str] = Counter()
        """Events of requests' lives (completed, failed:<status>, requeued...); :meth:`events` adds the parts'."""
        self.dispatched: Counter[str] = Counter()
        # What the router persists (weights, flip sentinels, timelines, stats), written off its loop.
        self.files = FileWriter("router-files")
        self.timeline = Timeline(run_dir, self.files)
        # The parts.
        self.kv = KvRouting(cfg, self._to_replica)
        self.pool = ReplicaPool(cfg.router, cfg.seed, reserved_group(cfg.tail), self.kv.index, self.kv.admission)
        self.tail = TailRouting(cfg.tail, run_dir, self.files, self.pool)
        self.weights = WeightSync(run_dir, self.files, self.pool, self._to_replica, self._to_client)
        self.migrations = Migrations(moves_carry_kv(cfg), self._to_replica, self.queue, self.timeline)
        self.elastic = Elastic(self.pool, self._to_replica, self.migrations.start, self.weights.answer_clients)
        self.membership = Membership(cfg.router, self.pool, self.weights, self.elastic, self._to_replica,
                                     self._orphaned)
        self.empty_groups = EmptyGroups(cfg.router, self.groups, self.pool, self.queue, self.tail, self._fail)
        self.metrics: RouterMetrics | None = RouterMetrics() if cfg.report.metrics else None
        self._timer: DecisionTimer | None = self.metrics.timer(self._decide) if self.metrics else None
        self._seq = 0
        self.deadlines = Deadlines(self.live)
        self.frontend_addr = ""
        self.backend_addr = ""
        self.endpoint: Endpoint | None = None

    def _to_replica(self, ident: bytes, msg: P.Message) -> None:
        self.links.replica_msg(ident, msg)

    def _to_client(self, ident: bytes, msg: P.Message) -> None:
        self.links.client_msg(ident, msg)

    def _sockets(self) -> ZmqLinks:
        if not isinstance(self.links, ZmqLinks):
            raise TypeError("this router has no sockets: its links are not ZMQ's")
        return self.links

    # ---- lifecycle -------------------------------------------------------------------------
    def bind(self, host: str) -> dict[str, str]:
        self.frontend_addr, self.backend_addr = self._sockets().bind(host)
        self.tail.adopt_sentinels()
        info = {"frontend": self.frontend_addr, "backend": self.backend_addr, "pid": str(os.getpid())}
        if self.metrics is not None:
            self.endpoint = Endpoint(self.metrics.registry, host, self.run_dir, "router", {})
        atomic_write(self.run_dir.router_address, json.dumps(info))
        logger.info("router listening: frontend %s backend %s", self.frontend_addr, self.backend_addr)
        return info

    def close(self) -> None:
        self.links.close()
        if self.curve is not None:
            self.curve.close()
        if self.endpoint is not None:
            self.endpoint.close()
        self.files.close()

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        links = self._sockets()
        poller = zmq.Poller()
        poller.register(links.frontend, zmq.POLLIN)
        poller.register(links.backend, zmq.POLLIN)
        sweep_every = min(self.rcfg.heartbeat_s / 2, 0.25)
        next_sweep = clock.monotonic() + sweep_every
        next_move = clock.monotonic() + self.tail.tick_s() if self.tail.active else float("inf")
        while not should_stop():
            timeout_ms = max(0.0, (min(next_sweep, next_move) - clock.monotonic()) * 1000)
            events = dict(poller.poll(int(timeout_ms)))  # what pyzmq does with a float
            # Results first: they free the slots the new requests need.
            if links.backend in events:
                self._drain(links.backend, self.on_backend)
                self.dispatch()
            changed = False
            if links.frontend in events:
                self._drain(links.frontend, self.on_frontend)
                changed = True
            now = clock.monotonic()
            if now >= next_sweep:
                # What the replicas sent is read before their silence is judged: after a stall of this
                # loop (a long pass, a descheduled process) their heartbeats wait unread, and would not
                # count. Most sweeps find nothing more: one failed read.
                while self._drain(links.backend, self.on_backend):
                    pass
                self.sweep()
                next_sweep = clock.monotonic() + sweep_every
                changed = True
            if now >= next_move:
                self.move_long_runners()
                next_move = clock.monotonic() + self.tail.tick_s()
            if changed:  # else the dispatch after the backend drain has already seen this state
                self.dispatch()

    def _drain(self, sock: zmq.Socket, handle: Callable[..., None]) -> bool:
        """Handle up to _DRAIN messages; True if the socket may hold more."""
        for _ in range(_DRAIN):
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return False
            if len(frames) < 3:
                logger.warning("dropped a malformed message of %d frame(s)", len(frames))
                self.stats["malformed"] += 1
                continue
            try:
                handle(*frames)
            except P.ProtocolError as exc:
                logger.warning("dropped a malformed message: %s", exc)
                self.stats["malformed"] += 1
        return True

    # ---- frontend --------------------------------------------------------------------------
    def on_frontend(self, client: bytes, mtype: bytes, payload: bytes, *_: bytes) -> None:
        if mtype == _T_GENERATE:
            try:
                msg = _dec_generate.decode(payload)
            except Exception as exc:  # msgspec raises DecodeError or ValidationError
                rid = P.request_id_of(payload)
                cached = self.answered.result(rid) if rid is not None else None
                if cached is not None:  # a garbled resend of an answered request: its one Result again
                    self.links.to_client(client, _T_RESULT, cached)
                elif rid is not None and rid not in self.live:  # it fails, at once, instead of waiting
                    bad = P.Result(request_id=rid, status="client_error", error=f"bad Generate: {exc}")
                    self.links.to_client(client, _T_RESULT, _enc.encode(bad))
                # (a garbled resend of a live request is dropped: the request answers once, as it runs)
                raise P.ProtocolError(f"bad Generate: {exc}") from exc
            self.submit(client, msg, payload)
            return
        msg = P.decode(mtype, payload)
        if isinstance(msg, P.Abort):
            self.abort(msg.request_id)
        elif isinstance(msg, P.StepBegin):
            self.tail.step_begin(msg.job, msg.step, msg.n_sessions)
            self.timeline.begin(msg.job, msg.step)
            self.pool.reweight()
            self.links.client_msg(client, msg)
        elif isinstance(msg, P.SessionDone):
            self.kv.session_done(msg.session_id)
            flip = self.tail.session_done(msg.job, msg.step, msg.session_id)
            if flip is not None:
                self.timeline.flipped(msg.job, msg.step, *flip)
                self.move_long_runners()
        elif isinstance(msg, P.StatusRequest):
            self.links.client_msg(client, self.status())
        elif isinstance(msg, P.UpdateWeights):
            self.weights.update(client, msg)
        elif isinstance(msg, P.StreamWeights):
            self.weights.stream(client, msg)
        elif isinstance(msg, P.Drain):
            self.elastic.drain(msg.replicas, msg.migrate)
        else:
            raise P.ProtocolError(f"{type(msg).__name__} is not a frontend message")

    def submit(self, client: bytes, msg: P.Generate, payload: bytes) -> None:
        rid = msg.request_id
        cached = self.answered.result(rid)
        if cached is not None:
            self.stats["duplicates"] += 1
            self.links.to_client(client, _T_RESULT, cached)
            return
        existing = self.live.get(rid)
        if existing is not None:
            # A resend (e.g. after a reconnect): answer whichever client asked last, once.
            existing.client = client
            self.stats["duplicates"] += 1
            return
        # FIFO (a baseline for benchmarks) is the fair queue with every request under one job.
        job = "*" if self.rcfg.queue == "fifo" else (msg.job or f"model:{msg.model}")
        self._seq += 1
        req = Request(msg, payload, client, job, self._seq, clock.wall())
        if self.answered.aborted_early(rid):
            self._fail(req, "cancelled", "aborted before it arrived")
            return
        error = self._check(req)
        if error:
            self._fail(req, "client_error", error)
            return
        self.kv.submitted(req)
        self.live[rid] = req
        if msg.deadline:
            self.deadlines.add(req)
        self.queue.push(req)
        self.stats["submitted"] += 1

    def _check(self, req: Request) -> str:
        """Client errors that need no engine: a reserved id, a deadline that is no time, unknown group,
        empty prompt, limits of the group."""
        msg = req.msg
        if msg.request_id.startswith(PROBE_PREFIX):
            return f"request ids starting with {PROBE_PREFIX!r} are the router's own (its readiness probes)"
        if not math.isfinite(msg.deadline):
            return f"deadline {msg.deadline} is not a time: seconds since the epoch, or 0 for none"
        if msg.group is not None and msg.group not in self.groups:
            return f"unknown group {msg.group!r}; groups: {sorted(self.groups)}"
        if not msg.prompt_token_ids:
            return "empty prompt"
        limits = self.pool.limits(msg.group)
        return limit_error(req, *limits) if limits else ""

    def abort(self, rid: str) -> None:
        req = self.live.get(rid)
        if req is None:
            self.answered.abort_unknown(rid)
            return
        if req.replica is None:
            self.queue.discard(req)
            self._fail(req, "cancelled", "aborted before dispatch")
        else:
            req.client_aborted = True
            r = self.pool.get(req.replica)
            if r is not None:
                self.links.replica_msg(r.identity, P.Abort(rid))

    def status(self) -> P.Status:
        replicas = self.pool.all()
        return P.Status(groups=self.pool.group_status(self.groups, self.weights.is_stale), queued=self.queue.size,
                        inflight=sum(r.load for r in replicas),
                        completed=self.stats["completed"], steps=self.tail.progress(self.timeline),
                        loading=sorted(r.replica_id for r in replicas
                                       if not r.draining and self.weights.is_loading(r)),
                        weights_version=self.weights.landed,
                        kv=self.kv.status(replicas, self.queue.waiting_for(self.groups | {None})))

    # ---- dispatch --------------------------------------------------------------------------
    def _decide(self, req: Request) -> Replica | None:
        """The replica this request would go to now, or None if it must wait."""
        g, fallback = self.tail.targets(req)
        if req.deaths:
            r = self.pool.choose_for_suspect(g)
            return r if r is not None or fallback is None else self.pool.choose_for_suspect(fallback)
        key = req.msg.session_id or req.request_id
        r = self.pool.choose(g, key, req)
        if r is None and fallback is not None:
            r = self.pool.choose(fallback, key, req)
        return r

    def move_long_runners(self) -> None:
        """Move what tail routing picks (long runners; after a flip, the step's running requests)."""
        now = clock.monotonic()
        for req, r in self.tail.to_move(now):
            why = "tail" if self.tail.flipped(req.msg.job, req.msg.step) else self.cfg.tail.policy
            self.migrations.start(req, r, why, self.tail.group)
        for req, r, out, t in self.tail.to_trade(now):  # the tail group is full: places change hands
            self.migrations.start(out, t, "trade", None)
            self.migrations.start(req, r, self.cfg.tail.policy, self.tail.group)

    def dispatch(self) -> None:
        pool = self.pool
        if pool.admission is not None:
            pool.admission.held_back.clear()  # each pass gives the queue's order its turn again
        while self.queue.size and pool.spare_slots(None) > 0:
            timer = self._timer
            choose = timer if timer is not None and timer.left else self._decide
            taken = 0
            for req, replica in self.queue.pop_round(choose):
                taken += 1  # sent, or failed: either way the requests behind it get their turn
                error = limit_error(req, replica.max_model_len, replica.vocab_size)
                if error and req.prefix_tokens:
                    self._end_moved(req, replica, error)
                elif error:
                    self._fail(req, "client_error", error)
                else:
                    self._send(req, replica)
            if not taken:
                return

    def _end_moved(self, req: Request, r: Replica, error: str) -> None:
        """A moved request's continuation does not fit where it was to go on (a group of a shorter
        ``max_model_len``): it ends with the tokens it has, as an engine ends a sequence at its limit."""
        logger.warning("request %s ends after %d tokens: its continuation does not fit %s (%s)",
                       req.request_id, len(req.prefix_tokens), r.replica_id, error)
        self.stats["ended_at_move"] += 1
        res = P.Result(request_id=req.request_id, finish_reason="length", replica_id=r.replica_id, group=r.group,
                       weight_version=req.prefix_versions[-1] if req.prefix_versions else 0)
        self._answer(req, "ok", 0, b"", res)

    def _send(self, req: Request, r: Replica) -> None:
        self.links.to_replica(r.identity, _T_GENERATE, req.payload)
        now = clock.monotonic()
        if not r.inflight:
            r.restart_stall_clock(now)  # the stall clock runs only while work is in flight
        self.pool.take_slot(r, req)
        self.tail.dispatched(req, r, now)
        self.kv.sent(req, r, now)
        req.replica = r.replica_id
        req.group = r.group
        req.t_dispatch = clock.wall()
        req.dispatches += 1
        self.timeline.dispatched(req.msg.job, req.msg.step, r.group, req.t_dispatch)
        self.dispatched[r.group] += 1

    def _release(self, r: Replica, req: Request) -> None:
        """Take a request off a live replica (answered, expired), freeing its slot."""
        if self.pool.release_slot(r, req):
            self.timeline.finished(req.msg.job, req.msg.step, r.group, clock.wall())
            if r.draining:
                self.elastic.shutdown_if_idle(r)

    # ---- backend ---------------------------------------------------------------------------
    def on_backend(self, ident: bytes, mtype: bytes, payload: bytes, kv: bytes = b"", *_: bytes) -> None:
        """``kv``: a Result's replica's ``KvEvents`` since its last, in the same message (applied first)."""
        if mtype == _T_RESULT:
            r = self.pool.known(ident)
            if kv:
                try:
                    self.kv.events(r, _dec_kv.decode(kv))
                except Exception as exc:  # the batch is lost (the next one shows the gap), not the Result
                    logger.warning("dropped a malformed KV events batch: %s", exc)
                    self.stats["malformed"] += 1
            try:
                head = _dec_head.decode(payload)
            except Exception as exc:
                raise P.ProtocolError(f"bad Result: {exc}") from exc
            self._on_result(r, head, payload)
            return
        msg = P.decode(mtype, payload)
        if isinstance(msg, P.Heartbeat):
            self.membership.heartbeat(ident, msg)
            self.kv.heard(self.pool.known(ident), msg.kv_seq)
        elif isinstance(msg, P.Register):
            self.membership.register(ident, msg)
        elif isinstance(msg, P.KvEvents):
            self.kv.events(self.pool.known(ident), msg)
        elif isinstance(msg, P.KvSnapshot):
            self.kv.snapshot(self.pool.known(ident), msg)
        elif isinstance(msg, P.WeightsUpdated):
            r = self.pool.known(ident)
            if r is not None:
                self.weights.acknowledged(r, msg)
        elif isinstance(msg, P.Leaving):
            r = self.pool.known(ident)
            if r is not None:
                self.membership.drop(r, f"it is leaving: {msg.reason}", blame=False)
        else:
            raise P.ProtocolError(f"{type(msg).__name__} is not a backend message")

    def _on_result(self, r: Replica | None, head: P.ResultHead, payload: bytes) -> None:
        """``r``: the registered replica the Result came from (None: none is, by that identity). The
        Result is decoded whole only where the router reads or rewrites its tokens."""
        if head.request_id.startswith(PROBE_PREFIX):
            if r is not None:
                self.membership.probe_answered(r, P.decode_as(P.Result, payload))
            return
        req = self.live.get(head.request_id)
        if req is None or r is None or req.replica != r.replica_id:
            # A late answer from a replica the request was taken away from: the request already
            # has (or will get) its one Result elsewhere.
            self.stats["stale_results"] += 1
            return
        status = head.status
        moved = bool(req.migrating) and status == "cancelled" and not req.client_aborted
        # Decoded before anything changes: a Result that does not decode leaves the request as it was.
        res = P.decode_as(P.Result, payload) if moved or req.prefix_tokens else None
        n_out = P.array_len(head.output_token_ids) if status != "engine_dead" else 0
        why, req.migrating = req.migrating, ""
        self._release(r, req)
        if status == "engine_dead":
            self.membership.engine_died(r, head.error)
            if self._died_under(req, r.replica_id, head.error):
                self.queue.requeue_front([req])
            return
        if moved:
            assert res is not None
            if n_out < req.msg.sampling.max_tokens:
                self.migrations.resume(req, res, why)
                return
            # The Abort came after the budget's last token: nothing to continue, the request is done.
            status = "ok"
            res = msgspec.structs.replace(res, status=status, finish_reason="length")
            payload = _enc.encode(res)
        self._answer(req, status, n_out, payload, res)

    def _answer(self, req: Request, status: str, n_out: int, payload: bytes, res: P.Result | None) -> None:
        """``req`` ends with ``n_out`` tokens of its last leg (``res`` decoded: needed when it carries the
        tokens of earlier legs, merged into its one Result)."""
        n = len(req.prefix_tokens) + n_out
        if status == "ok":
            self.tail.finished(req, n)
        self.kv.answered(req, n, clock.monotonic())
        if req.prefix_tokens:
            assert res is not None
            payload = self.migrations.merged(req, res)
        self._complete(req, payload, status)

    # ---- requests whose replica died ---------------------------------------------------------
    def _orphaned(self, r: Replica, reqs: list[Request], why: str, blame: bool = True) -> None:
        """A dropped replica's requests go back to the front of their jobs' queues (or fail as poison);
        ``blame``: the replica died or went silent with them in it (a death counted against each)."""
        now = clock.wall()
        back = []
        for req in reqs:
            self.timeline.finished(req.msg.job, req.msg.step, r.group, now)
            if self._died_under(req, r.replica_id, why, blame):
                back.append(req)
        self.queue.requeue_front(back)  # all at once: in their order of submission

    def _died_under(self, req: Request, replica_id: str, why: str, blame: bool = True) -> bool:
        """``req``'s replica died (or left) under it: True if it goes back to the queue (the caller's
        to put it there); else it was answered (aborted by its client, or poison)."""
        if req.client_aborted:  # nobody waits for it: not run again
            self._fail(req, "cancelled", f"aborted; its replica {replica_id} went ({why})")
            return False
        if blame:
            req.deaths = (*req.deaths, f"{replica_id}: {why}")
        req.replica = None
        req.migrating = ""  # requeued whole from its last leg: no partial Result to continue from
        self.tail.forget(req)  # a move it was on is off: it no longer holds the tail group's room
        if len(req.deaths) >= self.rcfg.max_engine_deaths:
            # Poison: this request was in flight at every one of these deaths; stop it killing more.
            self._fail(req, "engine_dead", f"in flight at {len(req.deaths)} engine deaths ({'; '.join(req.deaths)})")
            return False
        self.stats["requeued"] += 1
        return True

    # ---- completion ------------------------------------------------------------------------
    def _complete(self, req: Request, payload: bytes, status: str = "ok") -> None:
        if self.live.pop(req.request_id, None) is not None and req.msg.deadline:
            self.deadlines.done()
        self.tail.forget(req)
        route = P.Route(queue_s=max(0.0, req.t_dispatch - req.t_submit), dispatched_at=req.t_dispatch,
                        dispatches=req.dispatches, moves=req.moves, kv_block_size=self._kv_block_size())
        self.links.to_client(req.client, _T_RESULT, payload, _enc.encode(route))
        self.answered.keep(req.request_id, payload)
        self.stats["completed"] += 1
        if self.metrics is not None:
            self.metrics.completed(req, status, clock.wall())

    def _kv_block_size(self) -> int:
        index = self.kv.index
        return index.client_block_size if index is not None else 0

    def _fail(self, req: Request, status: str, error: str) -> None:
        res = P.Result(request_id=req.request_id, status=status, error=error)
        self.stats[f"failed:{status}"] += 1
        self._complete(req, _enc.encode(res), status)

    # ---- timers ----------------------------------------------------------------------------
    def sweep(self) -> None:
        self.membership.check(clock.monotonic())
        wall = clock.wall()
        self.empty_groups.check(wall)
        self.weights.answer_clients()  # an answer may wait for weights.json
        if self.deadlines:
            self._expire(wall)
        if self.kv.on:
            self.kv.sweep(clock.monotonic(), self.live.values())
        if self.metrics is not None:
            self.metrics.publish(self.pool.all(), self.queue.depths(), self.events(), self.kv.status(self.pool.all(), ()))
        if self._timer is not None:
            self._timer.arm()

    def _expire(self, wall: float) -> None:
        for req in self.deadlines.due(wall):
            if req.replica is None:
                self.queue.discard(req)
            else:
                r = self.pool.get(req.replica)
                if r is not None:
                    self._release(r, req)
                    self.links.replica_msg(r.identity, P.Abort(req.request_id))
            self._fail(req, "timeout", "deadline passed")

    def events(self) -> Counter[str]:
        """Every event the router counted: its own, engine deaths, moves by reason."""
        return self.stats + self.membership.events + self.migrations.events

    def write_stats(self) -> None:
        self.timeline.write_all()
        stats = {**self.events(), **{f"dispatched:{g}": n for g, n in self.dispatched.items()}}
        self.files.write(self.run_dir.router_stats, json.dumps(stats, indent=1))
