"""The replica process: one engine served to the router over a DEALER socket.

It registers with its group and labels, answers the router's readiness probe with a real
generation, sends heartbeats with the engine's load and prefix-cache counters, runs every Generate
as its own task, and forwards Aborts to the engine. If the router's address file changes (the router
restarted) it reconnects and registers again.

Weights (``UpdateWeights``, ``StreamWeights``: ``replica_weights.py``) close a gate in front of the
engine (``gate.py``): requests that arrive meanwhile wait there and run afterwards; per
``rollout.update_mode`` the requests in the engine go on with the new weights or finish first. Every
Result names the versions of its tokens (``Result.weight_versions``): the engine's own account if it
keeps one, else the versions the replica saw while the request was in the engine.

Engine deaths need the engine to itself: new requests wait at the gate while the ones in the engine
fail at once (``engine_dead``, and the router requeues them); then the engine restarts. An engine
that cannot come back (``EngineGone``) ends the process, and the cluster backend starts a replacement.

A drained replica (elastic scale-down) gets ``Shutdown`` from the router once it holds no request:
it closes the engine and its sockets and the process exits 0. SIGTERM (a preemption, the run's end)
makes it tell the router it leaves, then close the same way, within ``STOP_GRACE_S``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import sys
import time
from typing import Any

import zmq
import zmq.asyncio
from tokenizers import Tokenizer

from toolkit.config import (
    Config,
    SimEngineConfig,
    VllmEngineConfig,
    WeightsTransport,
    group_engine,
    kv_events_on,
)
from toolkit.config.entry import enter_component
from toolkit.core import protocol as P
from toolkit.core.errors import Terminated
from toolkit.core.lifecycle import ProcessRef, run_until_terminated, stdout_file, write_pidfile
from toolkit.core.metrics import Endpoint
from toolkit.core.names import process_name, replica_id
from toolkit.core.rundir import RunDir, atomic_write
from toolkit.core.security import client_curve
from toolkit.core.sockets import RouterLink, own_bind_host
from toolkit.engine.base import Engine, EngineGone, EngineInfo, make_engine
from toolkit.engine.gate import Gate
from toolkit.engine.kv_events import KvEventLog
from toolkit.engine.metrics import ReplicaMetrics
from toolkit.engine.replica_weights import ReplicaWeights
from toolkit.engine.vllm_transfer import STREAM_ARGS
from toolkit.model.tokenizer import chat_tokenizer_dir

logger = logging.getLogger(__name__)

STOP_GRACE_S = 20.0
"""From SIGTERM, the time a replica has to leave the router and stop its engine (vLLM's own shutdown
kills its engine core 5 s in); past it the replica writes every thread's stack to its output and exits."""


class ReplicaServer:
    def __init__(self, cfg: Config, run_dir: RunDir, group: str, index: int, engine: Engine) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.group = group
        self.engine = engine
        engine.on_pids = self._record_engine_pids  # its processes as they appear, a boot included
        self._boot_pids: set[int] = set()
        self.replica_id = replica_id(group, index, f"{socket.gethostname()}:{os.getpid()}")
        self.gcfg = cfg.groups[group]
        self.ctx = zmq.asyncio.Context()
        self.link = RouterLink(self.ctx, run_dir.router_address, "backend", client_curve(run_dir.root),
                               routing_id=self.replica_id)
        self.info: EngineInfo | None = None
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.name = process_name(group, index)
        self.gate = Gate()
        """Closed while weights load or a dead engine restarts."""
        self._recovery: asyncio.Task[None] | None = None
        self._fatal: BaseException | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.metrics = ReplicaMetrics(lambda: len(self.tasks)) if cfg.report.metrics else None
        self.kv: KvEventLog | None = None
        """Its engine's KV events, when the router routes on them (``kv_events_on``)."""
        self.weights = ReplicaWeights(engine, self.gate, cfg.rollout.update_mode, self.replica_id,
                                      lambda m: self._send(m), self._spawn, self._check_engine, self.metrics)

    async def _send(self, msg: P.Message, *more: bytes) -> None:
        """``more``: frames after the message's own (a Result's KV events batch)."""
        await self.link.send([*P.encode(msg), *more])

    async def _register(self) -> None:
        assert self.info is not None
        labels = {"group": self.group, **self.gcfg.labels}
        await self._send(P.Register(
            replica_id=self.replica_id, group=self.group, labels=labels, model=self.info.model,
            max_inflight=self.gcfg.max_inflight, max_model_len=self.info.max_model_len,
            vocab_size=self.info.vocab_size,
            # A restarted router learns from it which weights are the run's newest (WeightSync.registered).
            weights=self.weights.held,
            streams=self.engine.stream_transport, stream_ranks=self.engine.stream_ranks,
            kv_block_size=self.info.kv_block_size if self.kv is not None else 0,
            kv_capacity_tokens=self.info.kv_capacity_tokens,
        ))

    async def _send_kv(self) -> None:
        """The KV events batch since the last one, if anything happened: with heartbeats (and in each
        Result's message, so the router knows where its context is cached before the session's next turn)."""
        if self.kv is not None:
            batch = self.kv.take()
            if batch is not None:
                await self._send(batch)

    async def _kv_snapshot(self) -> None:
        if self.kv is not None:
            await self._send(self.kv.snapshot(self.engine.kv_held()))

    async def run(self) -> None:
        logger.info("replica %s waits for the router's address (%s)", self.replica_id, self.run_dir.router_address)
        addr = await self.run_dir.await_router_address(self.cfg.cluster.ready_timeout_s)
        if kv_events_on(self.cfg):
            self.kv = self.engine.kv_events()
        self.info = await self.engine.start()
        self._record_engine_pids()
        endpoint = None
        if self.metrics is not None:
            endpoint = Endpoint(self.metrics.registry, own_bind_host(self.cfg.router.host, self.cfg.cluster.type),
                                self.run_dir, self.name, {"group": self.group, "replica": self.replica_id})
        self.link.connect(addr["backend"])
        logger.info("replica %s connected to %s", self.replica_id, self.link.address)
        await self._register()
        beat = asyncio.create_task(self._heartbeats(), name="heartbeats")
        try:
            await self._receive()
        except (Terminated, KeyboardInterrupt, asyncio.CancelledError) as exc:
            await self._leave(exc)
            raise
        finally:
            if endpoint is not None:
                endpoint.close()
            beat.cancel()
            for t in list(self._background):
                t.cancel()
            for t in list(self.tasks.values()):
                t.cancel()
            await self.engine.close()
            self.link.close()
            self.ctx.term()

    async def _leave(self, exc: BaseException) -> None:
        """Stopped from outside (SIGTERM: a preemption, a kill, the run's end): the router hears it now,
        and sends what it had here elsewhere without counting it against the requests. (A failure of the
        replica's own says nothing: the router finds it out by its silence, and counts it.)"""
        why = f"stopped from outside ({type(exc).__name__})"
        logger.warning("leaving the router (%s)", why)
        try:
            await asyncio.wait_for(self._send(P.Leaving(why)), 1.0)
        except Exception as e:  # noqa: BLE001 - the router finds out by the missed heartbeats instead
            logger.warning("could not tell the router this replica is leaving: %s", e)

    async def _heartbeats(self) -> None:
        failed = 0
        while True:
            await asyncio.sleep(self.cfg.router.heartbeat_s)
            try:
                await self._beat()
                failed = 0
            except Exception as exc:
                # One bad beat costs that beat. A replica that cannot beat at all is dropped by the router
                # as silent; it ends (exit 75: the cluster replaces it) rather than serve unseen.
                failed += 1
                logger.exception("heartbeat %d in a row failed", failed)
                if failed >= self.cfg.router.missed_heartbeats:
                    self._fatal = EngineGone(f"its heartbeats failed {failed} times in a row: {exc!r}")
                    return

    async def _beat(self) -> None:
        self._check_engine()
        s = self.engine.stats()
        if self.metrics is not None:
            self.metrics.stats = s
        await self._send_kv()
        # Every batch up to kv.seq went out before this (each is sent as it is taken).
        await self._send(P.Heartbeat(self.replica_id, s, self.kv.seq if self.kv is not None else 0))

    async def _follow_router(self) -> None:
        if not await self.link.follow():
            return
        logger.warning("router moved to %s; reconnected", self.link.address)
        await self._register()
        # The new router does not know this replica's requests: their clients resend them there,
        # so the local copies are dropped rather than answered to nobody.
        for t in list(self.tasks.values()):
            t.cancel()
        for rid in list(self.tasks):
            await self.engine.abort(rid)

    async def _receive(self) -> None:
        """The one task that reads the socket, and the only one that replaces it (on a move)."""
        interval = self.cfg.router.heartbeat_s
        next_check = time.monotonic() + interval
        while True:
            if self._fatal is not None:
                raise self._fatal
            if time.monotonic() >= next_check:
                await self._follow_router()
                next_check = time.monotonic() + interval
            frames = await self.link.recv(interval)
            if frames is None:
                continue
            if len(frames) != 2:
                logger.warning("dropped a message of %d frames", len(frames))
                continue
            try:
                msg = P.decode(frames[0], frames[1])
            except P.ProtocolError as exc:
                logger.warning("dropped: %s", exc)
                continue
            if isinstance(msg, P.Generate):
                if msg.request_id not in self.tasks:
                    # Named after its job: an abort at the gate counts its Result under the job too.
                    self.tasks[msg.request_id] = asyncio.create_task(self._generate(msg), name=msg.job)
            elif isinstance(msg, P.Abort):
                await self._abort(msg.request_id)
            elif isinstance(msg, P.UpdateWeights):
                self.weights.update(msg)
            elif isinstance(msg, P.StreamWeights):
                self.weights.stream(msg)
            elif isinstance(msg, P.KvResync):
                await self._kv_snapshot()
            elif isinstance(msg, P.Reregister):
                logger.info("router asked to re-register (%s)", msg.reason)
                await self._register()
            elif isinstance(msg, P.Shutdown):
                # The router holds nothing on this replica any more: run()'s cleanup closes the
                # engine and the sockets, and serve returns (exit code 0).
                logger.info("router asked to shut down (%s)", msg.reason)
                return
            else:
                logger.warning("unexpected %s from router", type(msg).__name__)

    async def _generate(self, msg: P.Generate) -> None:
        rid = msg.request_id
        t0 = time.monotonic()
        try:
            await self.gate.enter(rid, self.engine.weight_version)
            try:
                res = await self.engine.generate(msg)
            finally:
                seen = self.gate.leave(rid)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine's own failure: the router decides whether to retry
            logger.exception("request %s failed in the engine", rid)
            res = P.Result(request_id=rid, status="engine_dead", error=repr(exc))
            seen = [self.engine.weight_version]
        finally:
            self.tasks.pop(rid, None)
        if res.status == "engine_dead":
            self._check_engine()
        res.replica_id = self.replica_id
        res.group = self.group
        # The engine's account of the versions of its tokens if it keeps one (sim, vllm: exact), else
        # the versions the engine had while the request was in it (a drain: just one). Nothing awaits
        # between the engine's answer and here.
        res.weight_versions = P.join_versions(res.weight_versions or seen or [self.engine.weight_version])
        res.weight_version = res.weight_versions[-1]
        if self.metrics is not None:
            self.metrics.result(msg.job, res.status, len(res.output_token_ids), time.monotonic() - t0)
        # The KV events since the last batch ride with it: one message, in order.
        await self._send(res, *(self.kv.frames() if self.kv is not None else ()))

    async def _abort(self, rid: str) -> None:
        task = self.tasks.get(rid)
        if task is not None and rid not in self.gate.entered:
            # Still at the gate: the engine never saw it.
            task.cancel()
            self.tasks.pop(rid, None)
            if self.metrics is not None:
                self.metrics.result(task.get_name(), "cancelled", 0, 0.0)
            await self._send(P.Result(request_id=rid, status="cancelled", finish_reason="abort",
                                      replica_id=self.replica_id, group=self.group,
                                      error="aborted before it reached the engine"))
            return
        await self.engine.abort(rid)

    # ---- the engine to itself: restarts ------------------------------------------------------------
    def _spawn(self, coro: object, name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def _check_engine(self) -> None:
        if self.engine.dead() and (self._recovery is None or self._recovery.done()):
            where = stdout_file()
            logger.error("the engine died; its requests fail as engine_dead, new ones wait for a restart%s",
                         f" (why is in the engine's own output: {where})" if where else "")
            if self.metrics is not None:
                self.metrics.deaths.inc()
            self._recovery = self._spawn(self._recover(), "engine-restart")

    async def _recover(self) -> None:
        try:
            async with self.gate.exclusive():
                self.info = await self.engine.restart()
                self._record_engine_pids()
                held = self.weights.held
                if held is not None and held.version != self.engine.weight_version:
                    await self._lost_streamed_weights()
            if self.metrics is not None:
                self.metrics.restarts.inc()
            logger.info("engine restarted; %d request(s) were waiting", len(self.tasks))
        except Exception as exc:
            # Noticed by the receive loop, which ends the process (see serve).
            self._fatal = exc if isinstance(exc, EngineGone) else EngineGone(f"restart failed: {exc!r}")

    async def _lost_streamed_weights(self) -> None:
        """A restarted engine holds the last checkpoint it loaded, not the version streamed into it since:
        register again as holding that, so the router keeps it out of dispatch until it has the run's
        weights. The requests at the gate go back to the router with the old registration (it runs them
        elsewhere): here they would run on the older weights."""
        logger.warning("the restarted engine holds weights version %d, not the streamed version %d: registering "
                       "again", self.engine.weight_version, self.weights.held.version if self.weights.held else 0)
        self.weights.held = None
        for t in list(self.tasks.values()):
            t.cancel()
        self.tasks.clear()
        await self._register()

    def _record_engine_pids(self, pids: list[int] | None = None) -> None:
        """Pid files for the engine's own processes, so teardown stops them by pid even if this process is
        killed (vLLM's engine core outlives a SIGKILLed parent): ``pids``, those seen while it boots (a
        replica stopped then leaves none unknown); without, the engine's, once it is up, and the boot's
        others (its helpers, short-lived commands) forgotten."""
        name = f"{self.name}-engine"
        if pids is not None:
            self._boot_pids.update(pids)
        else:
            pids = self.engine.pids()
            for pid in self._boot_pids - set(pids):
                self.run_dir.pidfile(name, pid).unlink(missing_ok=True)
            self._boot_pids.clear()
        for pid in pids:
            write_pidfile(self.run_dir.pidfile(name, pid), ProcessRef.of(pid, name))


def engine_config(cfg: Config, group: str) -> Any:
    """The engine config of a replica of ``group``. An agent workload's sim speaks the workload's
    tokenizer: it emits ids of that vocabulary and encodes structured outputs (tool calls, JSON) with it."""
    ecfg = group_engine(cfg, group)
    if isinstance(ecfg, SimEngineConfig) and cfg.workload.agent and ecfg.tokenizer is None:
        path = chat_tokenizer_dir(cfg)
        vocab = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
        ecfg = dataclasses.replace(ecfg, tokenizer=str(path), vocab_size=min(ecfg.vocab_size, vocab))
    if isinstance(ecfg, VllmEngineConfig) and cfg.rollout.weights_transport == WeightsTransport.stream:
        # The toolkit's weight-transfer backend in vLLM's workers (toolkit/engine/vllm_transfer.py).
        ecfg = dataclasses.replace(ecfg, args={**ecfg.args, **STREAM_ARGS})
    return ecfg


def serve(run_dir: str, group: str, index: int, owner: ProcessRef | None = None) -> None:
    """Entry point of one replica process (a submitit job)."""
    name = process_name(group, index)
    rd, cfg = enter_component(run_dir, name, owner)
    engine = make_engine(engine_config(cfg, group))
    try:
        run_until_terminated(ReplicaServer(cfg, rd, group, index, engine).run(), STOP_GRACE_S)
        atomic_write(rd.replica_stopped(name), "drained")  # run() returns at the router's Shutdown alone
    except (KeyboardInterrupt, SystemExit):
        logger.info("replica %s stopping", name)
    except EngineGone as exc:
        logger.error("replica %s exits: %s", name, exc)
        sys.exit(75)  # EX_TEMPFAIL: the cluster backend starts a replacement


if __name__ == "__main__":  # RUN_DIR GROUP INDEX [OWNER: pid:start of the process it ends with]
    import sys

    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), ProcessRef.from_arg(sys.argv[4]) if len(sys.argv) > 4 else None)
