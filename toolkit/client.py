"""Client library of the router, used by the rollout ranks (async) and by ``launch`` (status, drain).

Each client owns one DEALER socket. Results are matched to requests by id. If the router's address
file changes (the router restarted), the client reconnects and resends every outstanding request;
the router answers duplicates once, so callers see exactly one Result per request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from toolkit.core import protocol as P
from toolkit.core.blocks import Chains, block_hashes
from toolkit.core.errors import RouterRefused, RouterUnavailable, ToolkitError
from toolkit.core.rundir import RunDir
from toolkit.core.security import ClientCurve, client_curve
from toolkit.core.sockets import RouterLink, make_socket

logger = logging.getLogger(__name__)

CHAINS_KEPT = 4096
"""Sessions whose last prompt's block hashes a client keeps, so a next turn hashes only its new blocks (a
session's go at its ``session_done``; a rank runs far fewer at once)."""

_T_RESULT = P.TYPE_OF[P.Result]
_T_STEP = P.TYPE_OF[P.StepBegin]
_T_STATUS = P.TYPE_OF[P.Status]
_T_WEIGHTS = P.TYPE_OF[P.WeightsUpdated]
_T_PLAN = P.TYPE_OF[P.StreamPlan]
_T_WANTED = P.TYPE_OF[P.StreamWanted]


def hash_prompt(chains: Chains, msg: P.Generate, block_size: int) -> None:
    """``msg`` carries its prompt's block hashes at ``block_size`` (``Generate.block_hashes``): those of the
    blocks its session's last prompt (in ``chains``) did not have, as the router keeps those, or all."""
    if msg.session_id:
        hashes, kept = chains.extend(msg.session_id, msg.prompt_token_ids, block_size)
        msg.block_hashes, msg.hashes_from = hashes[kept:], kept
    else:
        msg.block_hashes = block_hashes(msg.prompt_token_ids, block_size)
    msg.block_size = block_size


class WeightsUpdateFailed(ToolkitError):
    """A replica could not load the checkpoint (the router's answer names each one and why)."""


def _dealer(ctx: zmq.Context, address: str, curve: ClientCurve | None = None) -> zmq.Socket:
    s = make_socket(ctx, zmq.DEALER, curve=curve)
    s.connect(address)
    return s


class RouterClient:
    def __init__(self, run_dir: RunDir, watch_interval_s: float = 0.5) -> None:
        self.run_dir = run_dir
        self.watch_interval_s = watch_interval_s
        self.ctx = zmq.asyncio.Context()
        self.link = RouterLink(self.ctx, run_dir.router_address, "frontend", client_curve(run_dir.root))
        self.pending: dict[str, tuple[P.Generate, asyncio.Future[tuple[P.Result, P.Route | None]]]] = {}
        self._callers: Counter[str] = Counter()
        """Calls of :meth:`generate` waiting on each pending request id."""
        self.step_acks: dict[tuple[str, int], asyncio.Future[None]] = {}
        self.status_waiters: list[asyncio.Future[P.Status]] = []
        self.weight_acks: dict[int, asyncio.Future[P.WeightsUpdated]] = {}
        self.stream_plans: dict[tuple[int, str], asyncio.Future[P.StreamPlan]] = {}
        self.on_stream_wanted: Callable[[P.StreamWanted], None] | None = None
        """Called with every ``StreamWanted`` (the trainer's ``Streamer`` sends that replica a dense copy)."""
        self._tasks: list[asyncio.Task[None]] = []
        self.reconnects = 0
        # Step messages of the latest step, replayed to a restarted router so its tail counts agree.
        self.last_step_begin: P.StepBegin | None = None
        self.dones: list[P.SessionDone] = []
        self.kv_block_size = 0
        """The block size the router's KV index reads prompts at (its ``Route.kv_block_size``): with one, each
        prompt's block hashes go with it, computed here rather than on the router's one thread."""
        self.chains = Chains(CHAINS_KEPT)
        self.refused: RouterRefused | None = None
        """Why the router refused this client's handshake, once it did (every call raises it then)."""

    async def connect(self, timeout_s: float = 60.0) -> None:
        info = await self.run_dir.await_router_address(timeout_s)
        self.link.connect(info["frontend"])
        self._tasks = [asyncio.create_task(self._receive(), name="client-recv")]

    async def close(self) -> None:
        """Stop the receiver and close the socket; idempotent. Never raises: it runs in the ``finally``
        of whatever failed, whose error is the one to report."""
        tasks, self._tasks = self._tasks, []
        try:
            for t in tasks:
                t.cancel()
            for t in tasks:
                try:
                    await t
                except asyncio.CancelledError:
                    pass
                except Exception:
                    logger.exception("the client's receiver had failed")
        finally:
            self.link.close()
            if not self.ctx.closed:
                self.ctx.term()

    async def _send(self, msg: P.Message) -> None:
        if self.refused is not None:
            raise self.refused
        await self.link.send(P.encode(msg))

    async def generate(self, msg: P.Generate) -> tuple[P.Result, P.Route | None]:
        """Submit one request; returns its Result and the router's Route facts (None for cached). A call
        with the id of a request in flight waits for that request's Result (one request, one Result)."""
        rid = msg.request_id
        entry = self.pending.get(rid)
        self._callers[rid] += 1
        try:
            if entry is not None:
                return await asyncio.shield(entry[1])  # (a caller that gives up leaves the others theirs)
            fut: asyncio.Future[tuple[P.Result, P.Route | None]] = asyncio.get_running_loop().create_future()
            self.pending[rid] = (msg, fut)
            if self.kv_block_size and not msg.block_size:
                hash_prompt(self.chains, msg, self.kv_block_size)
            await self._send(msg)
            return await asyncio.shield(fut)
        finally:
            self._callers[rid] -= 1
            if not self._callers[rid]:
                del self._callers[rid]
                self.pending.pop(rid, None)

    async def abort(self, request_id: str) -> None:
        if self.link.closed or self.refused is not None:
            return  # closed: the run is ending, and the router aborts what nobody waits for (refused: it has none)
        await self._send(P.Abort(request_id))

    async def status(self, timeout_s: float = 5.0) -> P.Status:
        """The router's view of its groups, queue and counters."""
        fut: asyncio.Future[P.Status] = asyncio.get_running_loop().create_future()
        self.status_waiters.append(fut)
        await self._send(P.StatusRequest())
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise RouterUnavailable(f"router did not answer a status request within {timeout_s}s") from None

    async def step_begin(self, job: str, step: int, n_sessions: int, timeout_s: float = 30.0) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.step_acks[(job, step)] = fut
        msg = P.StepBegin(job, step, n_sessions)
        self.last_step_begin = msg
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                await self._send(msg)
                try:
                    await asyncio.wait_for(asyncio.shield(fut), 1.0)
                    return
                except asyncio.TimeoutError:
                    if time.monotonic() > deadline:
                        raise RouterUnavailable(f"router did not acknowledge step {step} of {job}") from None
        finally:
            self.step_acks.pop((job, step), None)

    async def update_weights(self, path: str, version: int, timeout_s: float = 1800.0,
                             resend_s: float = 2.0) -> P.WeightsUpdated:
        """Have every ready replica load the checkpoint directory ``path`` as weight ``version`` (with
        its requests running, or after they finish: ``rollout.update_mode``); returns the router's
        answer once all have (``replicas`` = how many).
        Replicas that register later get it before they are ready. Resends (a restarted router learns
        the weights from the resend); raises WeightsUpdateFailed if a replica could not load it, or not
        within ``timeout_s`` (``rollout.load_timeout_s``), naming the replicas still loading it."""
        fut: asyncio.Future[P.WeightsUpdated] = asyncio.get_running_loop().create_future()
        self.weight_acks[version] = fut
        msg = P.UpdateWeights(path, version)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                await self._send(msg)
                try:
                    ack = await asyncio.wait_for(asyncio.shield(fut), resend_s)
                    break
                except asyncio.TimeoutError:
                    if time.monotonic() > deadline:
                        raise WeightsUpdateFailed(await self._not_loaded(path, version, timeout_s)) from None
        finally:
            self.weight_acks.pop(version, None)
        if ack.error:
            raise WeightsUpdateFailed(f"weights {path} (version {version}): {ack.error}")
        return ack

    async def stream_weights(self, msg: P.StreamWeights, timeout_s: float = 30.0
                             ) -> tuple[P.StreamPlan, asyncio.Future[P.WeightsUpdated] | None]:
        """Announce a streamed update; returns the router's plan and, for an update of every replica
        (not a catch-up: ``msg.target``), the future of its answer once every replica of the plan has
        answered (the caller sends the payload meanwhile, then awaits it and calls
        :meth:`forget_stream`). Sent once: an update is not resent (it would plan a second chain)."""
        key = (msg.version, msg.target)
        plan_fut: asyncio.Future[P.StreamPlan] = asyncio.get_running_loop().create_future()
        self.stream_plans[key] = plan_fut
        ack: asyncio.Future[P.WeightsUpdated] | None = None
        if not msg.target:
            ack = self.weight_acks[msg.version] = asyncio.get_running_loop().create_future()
        try:
            await self._send(msg)
            try:
                plan = await asyncio.wait_for(plan_fut, timeout_s)
            except asyncio.TimeoutError:
                raise RouterUnavailable(f"the router did not answer streamed update {msg.version} within "
                                        f"{timeout_s:g}s (has the run ended?)") from None
        except BaseException:
            self.forget_stream(msg.version)
            raise
        finally:
            self.stream_plans.pop(key, None)
        return plan, ack

    def forget_stream(self, version: int) -> None:
        self.weight_acks.pop(version, None)

    async def _not_loaded(self, path: str, version: int, timeout_s: float) -> str:
        """Why an update timed out, naming the replicas still loading it (a hung file system, a stuck
        engine) so the operator knows which node to look at."""
        why = f"weights {path} (version {version}) not loaded by every replica within {timeout_s:g}s"
        try:
            status = await self.status(timeout_s=5.0)
        except RouterUnavailable:
            return f"{why}, and the router does not answer"
        if status.loading:
            return f"{why}; still loading: {', '.join(status.loading)}"
        # Every replica has them: the answer waits for the router's record of them (weights.json).
        return (f"{why}: every replica acknowledged them, but the router has not answered: its write of "
                f"weights.json in the run dir may hang (a slow or stuck shared file system?)")

    async def session_done(self, job: str, step: int, session_id: str) -> None:
        msg = P.SessionDone(job, step, session_id)
        self.chains.forget(session_id)
        if self.dones and self.dones[-1].step != step:
            self.dones = []
        self.dones.append(msg)
        await self._send(msg)

    async def drain(self, replicas: list[str], migrate: bool = True) -> None:
        """Scale down: the replicas named ``<group>-<index>`` take no new request, their in-flight
        ones move elsewhere (``migrate``) or finish there, then they exit. Fire and forget, like
        ``session_done``: resend until they are gone (a Drain is idempotent)."""
        await self._send(P.Drain(list(replicas), migrate))

    async def _receive(self) -> None:
        """The one task that reads the socket, and the only one that replaces it (on a move)."""
        next_check = time.monotonic() + self.watch_interval_s
        while True:
            if time.monotonic() >= next_check:
                await self._follow_router()
                next_check = time.monotonic() + self.watch_interval_s
            try:
                frames = await self.link.recv(self.watch_interval_s)
            except RouterRefused as exc:
                self._refused(exc)
                return
            if frames is None:
                continue
            try:
                self._handle(frames)
            except P.ProtocolError as exc:
                logger.warning("dropped a bad message from the router: %s", exc)

    def _refused(self, exc: RouterRefused) -> None:
        """The router refused this client: everything waiting on it fails with why, and so does every
        later send (nothing sent would ever arrive)."""
        logger.error("%s", exc)
        self.refused = exc
        waiting: list[asyncio.Future[Any]] = [fut for _, fut in self.pending.values()]
        waiting += [*self.step_acks.values(), *self.status_waiters, *self.weight_acks.values(),
                    *self.stream_plans.values()]
        for fut in waiting:
            if not fut.done():
                fut.set_exception(exc)

    def _handle(self, frames: list[bytes]) -> None:
        mtype = frames[0]
        if mtype == _T_RESULT:
            res = P.decode_as(P.Result, frames[1])
            route = P.decode_as(P.Route, frames[2]) if len(frames) >= 3 else None
            if route is not None and route.kv_block_size != self.kv_block_size:
                self.kv_block_size = route.kv_block_size
                self.chains = Chains(CHAINS_KEPT)  # chains at another block size are of no use
            entry = self.pending.get(res.request_id)
            if entry is not None and not entry[1].done():
                entry[1].set_result((res, route))
        elif mtype == _T_STEP:
            ack = P.decode_as(P.StepBegin, frames[1])
            waiter = self.step_acks.get((ack.job, ack.step))
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        elif mtype == _T_WEIGHTS:
            done = P.decode_as(P.WeightsUpdated, frames[1])
            wfut = self.weight_acks.get(done.version)
            if wfut is not None and not wfut.done():
                wfut.set_result(done)
        elif mtype == _T_PLAN:
            plan = P.decode_as(P.StreamPlan, frames[1])
            pfut = self.stream_plans.get((plan.version, plan.target))
            if pfut is not None and not pfut.done():
                pfut.set_result(plan)
        elif mtype == _T_WANTED:
            if self.on_stream_wanted is not None:
                self.on_stream_wanted(P.decode_as(P.StreamWanted, frames[1]))
        elif mtype == _T_STATUS:
            st = P.decode_as(P.Status, frames[1])
            for w in self.status_waiters:
                if not w.done():
                    w.set_result(st)
            self.status_waiters.clear()

    async def _follow_router(self) -> None:
        """Follow the router to a new address and resend what it has not answered."""
        if not await self.link.follow():
            return
        self.reconnects += 1
        logger.warning("router moved to %s; resending %d outstanding request(s)", self.link.address,
                       len(self.pending))
        if self.last_step_begin is not None:
            await self._send(self.last_step_begin)
        for done in self.dones:
            await self._send(done)
        for msg, fut in list(self.pending.values()):
            if not fut.done():
                await self._send(msg)


def ready_counts(status: P.Status, want: dict[str, int]) -> dict[str, int]:
    """Ready replicas per wanted group (0 for a group the router has not heard of)."""
    return {g: status.groups[g].ready if g in status.groups else 0 for g in want}


def router_status(address: str, timeout_s: float = 2.0, ctx: zmq.Context | None = None,
                  curve: ClientCurve | None = None) -> P.Status | None:
    """Blocking status query (used by ``launch`` while it waits for readiness)."""
    return _status_after([], address, timeout_s, ctx, curve)


def send_drain(address: str, replicas: list[str], migrate: bool = True, timeout_s: float = 2.0,
               ctx: zmq.Context | None = None, curve: ClientCurve | None = None) -> P.Status | None:
    """Blocking ``Drain`` (used by ``launch`` to scale a group down; see ``RouterClient.drain``).
    Returns the router's Status right after it handled the Drain (its groups' ``draining`` counts),
    or None if the router did not answer within ``timeout_s``. Resend until the replicas' processes
    are gone: a router that restarted meanwhile drains them again."""
    return _status_after([P.Drain(list(replicas), migrate)], address, timeout_s, ctx, curve)


def _status_after(msgs: list[P.Message], address: str, timeout_s: float, ctx: zmq.Context | None,
                  curve: ClientCurve | None) -> P.Status | None:
    """Send ``msgs`` and a StatusRequest on one fresh connection; the router handles a connection's
    messages in order, so its Status answer also says the messages before it arrived."""
    ctx = ctx or zmq.Context.instance()
    s = _dealer(ctx, address, curve)
    try:
        for msg in [*msgs, P.StatusRequest()]:
            s.send_multipart(P.encode(msg))
        if s.poll(int(timeout_s * 1000)):
            frames = s.recv_multipart()
            if frames[0] == _T_STATUS:
                return P.decode_as(P.Status, frames[1])
        return None
    finally:
        s.close(0)
