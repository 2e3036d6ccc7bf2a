"""The replica process: one engine served to the router over a DEALER socket.

It registers with its group and labels, answers the router's readiness probe with a real
generation, sends heartbeats with the engine's load and prefix-cache counters, runs every Generate
as its own task, and forwards Aborts to the engine. If the router's address file changes (the router
restarted) it reconnects and registers again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from pathlib import Path

import zmq
import zmq.asyncio

from toolkit import protocol as P
from toolkit.config import Config, group_engine, load_run_config
from toolkit.engine.base import Engine, EngineInfo, make_engine
from toolkit.lifecycle import ProcessRef, exit_on_sigterm, setup_logging, watch_owner, write_pidfile
from toolkit.rundir import RunDir, read_json
from toolkit.sockets import make_socket

logger = logging.getLogger(__name__)


class ReplicaServer:
    def __init__(self, cfg: Config, run_dir: RunDir, group: str, index: int, engine: Engine) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.group = group
        self.engine = engine
        self.replica_id = f"{group}-{index}@{socket.gethostname()}:{os.getpid()}"
        self.gcfg = cfg.groups[group]
        self.ctx = zmq.asyncio.Context()
        self.sock: zmq.asyncio.Socket | None = None
        self.address = ""
        self.info: EngineInfo | None = None
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def _connect(self, address: str) -> None:
        if self.sock is not None:
            self.sock.close(0)
        s = make_socket(self.ctx, zmq.DEALER, self.replica_id)
        s.connect(address)
        self.sock = s
        self.address = address
        logger.info("replica %s connected to %s", self.replica_id, address)

    async def _send(self, msg: P.Message) -> None:
        assert self.sock is not None
        await self.sock.send_multipart(P.encode(msg))

    async def _register(self) -> None:
        assert self.info is not None
        labels = {"group": self.group, **self.gcfg.labels}
        await self._send(P.Register(
            replica_id=self.replica_id, group=self.group, labels=labels, model=self.info.model,
            max_inflight=self.gcfg.max_inflight, max_model_len=self.info.max_model_len,
            vocab_size=self.info.vocab_size,
        ))

    async def run(self) -> None:
        addr = await asyncio.to_thread(self.run_dir.wait_router_address, self.cfg.cluster.ready_timeout_s)
        self.info = await self.engine.start()
        self._connect(addr["backend"])
        await self._register()
        beat = asyncio.create_task(self._heartbeats(), name="heartbeats")
        try:
            await self._receive()
        finally:
            beat.cancel()
            for t in list(self.tasks.values()):
                t.cancel()
            await self.engine.close()
            if self.sock is not None:
                self.sock.close(0)
            self.ctx.term()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.router.heartbeat_s)
            s = self.engine.stats()
            await self._send(P.Heartbeat(self.replica_id, s.running, s.waiting, s.kv_usage,
                                         s.prefix_hits, s.prefix_queries, s.weight_version,
                                         s.generated_tokens))

    async def _follow_router(self) -> None:
        info = await asyncio.to_thread(read_json, self.run_dir.router_address)
        if not info or info["backend"] == self.address:
            return
        logger.warning("router moved to %s; reconnecting", info["backend"])
        self._connect(info["backend"])
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
            if time.monotonic() >= next_check:
                await self._follow_router()
                next_check = time.monotonic() + interval
            sock = self.sock
            assert sock is not None
            if not await sock.poll(int(interval * 1000), zmq.POLLIN):
                continue
            frames = await sock.recv_multipart()
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
                    self.tasks[msg.request_id] = asyncio.create_task(self._generate(msg))
            elif isinstance(msg, P.Abort):
                await self.engine.abort(msg.request_id)
            elif isinstance(msg, P.Reregister):
                logger.info("router asked to re-register (%s)", msg.reason)
                await self._register()
            else:
                logger.warning("unexpected %s from router", type(msg).__name__)

    async def _generate(self, msg: P.Generate) -> None:
        try:
            res = await self.engine.generate(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine's own failure: the router decides whether to retry
            logger.exception("request %s failed in the engine", msg.request_id)
            res = P.Result(request_id=msg.request_id, status="engine_dead", error=repr(exc))
        finally:
            self.tasks.pop(msg.request_id, None)
        res.replica_id = self.replica_id
        res.group = self.group
        await self._send(res)


def serve(run_dir: str, group: str, index: int, owner: ProcessRef | None = None) -> None:
    """Entry point of one replica process (a submitit job)."""
    rd = RunDir(Path(run_dir))
    name = f"replica-{group}-{index}"
    setup_logging(rd.logs / f"{name}.log")
    exit_on_sigterm()
    write_pidfile(rd.pids, name)
    watch_owner(owner)
    cfg = load_run_config(rd.root)
    engine = make_engine(group_engine(cfg, group))
    try:
        asyncio.run(ReplicaServer(cfg, rd, group, index, engine).run())
    except (KeyboardInterrupt, SystemExit):
        logger.info("replica %s stopping", name)


if __name__ == "__main__":
    import sys

    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]))
