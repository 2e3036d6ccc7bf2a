"""A replica's weight updates: checkpoints (``UpdateWeights``) and streamed versions (``StreamWeights``),
each taken per ``rollout.update_mode`` behind the replica's gate and acknowledged (``WeightsUpdated``).

- A checkpoint with ``pause``: new requests wait at the gate, the requests in the engine stay and go on
  with the new weights (``Engine.update_weights_in_place``; an engine without it drains instead, and
  says so once). With ``drain`` the requests in the engine finish on the old weights first.
- A streamed version is staged while the engine serves (the gate open: ``Engine.stage_stream``), then
  applied with the gate closed (``pause``) or once no request is in the engine (``drain``).

Nothing is aborted either way. ``held`` is what the replica registers with (``Register.weights``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from toolkit.core import protocol as P
from toolkit.engine.base import Engine
from toolkit.engine.gate import Gate
from toolkit.engine.metrics import ReplicaMetrics

logger = logging.getLogger(__name__)


class ReplicaWeights:
    def __init__(self, engine: Engine, gate: Gate, update_mode: str, replica_id: str,
                 send: Callable[[P.Message], Awaitable[None]],
                 spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]],
                 engine_failed: Callable[[], None], metrics: ReplicaMetrics | None) -> None:
        self.engine, self.gate, self.update_mode, self.replica_id = engine, gate, update_mode, replica_id
        self.send, self.spawn, self.engine_failed, self.metrics = send, spawn, engine_failed, metrics
        self.held: P.UpdateWeights | None = None
        """The weights the engine holds (None: the model's own; ``path`` empty: a streamed version)."""
        self.loading: tuple[str, int] | None = None
        """(path, version) of the update under way (path empty: streamed)."""
        self.in_place = True
        """Until the engine says it cannot update in place."""

    def _again(self, msg: P.UpdateWeights) -> None:
        """A resend (the router forwards every client retry), or the same weights handed out again by a
        later update (a rollback to them): acknowledge again, under the latest serial."""
        self.held = msg
        self.spawn(self.send(P.WeightsUpdated(msg.version, self.replica_id)), "weights-ack")

    # ---- checkpoints -------------------------------------------------------------------------------
    def update(self, msg: P.UpdateWeights) -> None:
        target = (msg.path, msg.version)
        if self.held is not None and target == (self.held.path, self.held.version):
            self._again(msg)
        elif target != self.loading:
            self.loading = target
            self.spawn(self._load(msg), f"weights-{msg.version}")

    async def _load(self, msg: P.UpdateWeights) -> None:
        target = (msg.path, msg.version)
        error = ""
        try:
            if not (self.update_mode == "pause" and self.in_place and await self._in_place(msg)):
                async with self.gate.exclusive():
                    t0 = time.monotonic()
                    logger.info("loading weights %s as version %d (the engine is idle)", msg.path, msg.version)
                    await self.engine.load_weights(msg.path, msg.version)
                    logger.info("weights version %d loaded in %.2fs", msg.version, time.monotonic() - t0)
            self.held = msg
        except Exception as exc:
            logger.exception("loading weights %s failed", msg.path)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.loading == target:
                self.loading = None
        if self.metrics is not None:
            mode = "in_place" if self.update_mode == "pause" and self.in_place else "drain"
            self.metrics.weight_loads.labels(mode, "error" if error else "ok").inc()
        await self.send(P.WeightsUpdated(msg.version, self.replica_id, error=error))

    async def _in_place(self, msg: P.UpdateWeights) -> bool:
        """``update_mode=pause``: False (nothing changed) if the engine cannot; the caller drains instead."""
        async with self.gate.closed():
            t0 = time.monotonic()
            logger.info("loading weights %s as version %d in place (%d request(s) in the engine)",
                        msg.path, msg.version, len(self.gate.entered))
            try:
                await self.engine.update_weights_in_place(msg.path, msg.version)
            except NotImplementedError as exc:
                self.in_place = False
                logger.warning("update_mode=pause: %s; weight updates drain the engine instead", exc)
                return False
            self.gate.switched(msg.version)
            logger.info("weights version %d loaded in place in %.2fs", msg.version, time.monotonic() - t0)
            return True

    # ---- streamed versions -------------------------------------------------------------------------
    def stream(self, msg: P.StreamWeights) -> None:
        if self.held is not None and not self.held.path and self.held.version == msg.version:
            self._again(P.UpdateWeights("", msg.version, msg.serial))
        elif self.loading is not None and self.loading != ("", msg.version):
            # One load at a time: a second stage would end the first one's transfer session in the engine.
            busy = f"RuntimeError: still loading weights version {self.loading[1]}"
            self.spawn(self.send(P.WeightsUpdated(msg.version, self.replica_id, error=busy)), f"busy-{msg.version}")
        elif self.loading is None:
            self.loading = ("", msg.version)
            self.spawn(self._load_stream(msg), f"stream-{msg.version}")

    async def _load_stream(self, msg: P.StreamWeights) -> None:
        error = ""
        t0 = time.monotonic()
        try:
            await self.engine.stage_stream(msg)  # a failed stage leaves nothing staged
            staged = time.monotonic()
            applying = False
            try:
                async with (self.gate.closed() if self.update_mode == "pause" else self.gate.exclusive()):
                    applying = True
                    await self.engine.apply_stream(msg.version)  # staged or not, nothing is left staged
                    self.gate.switched(msg.version)
            except BaseException:
                if applying:
                    self.engine_failed()  # an apply that could not put the old weights back killed the engine
                else:  # given up at the gate (cancelled: the replica stops): what was staged goes
                    with contextlib.suppress(Exception):
                        await self.engine.discard_stream()
                raise
            self.held = P.UpdateWeights("", msg.version, msg.serial)
            logger.info("streamed weights version %d: staged in %.2fs, applied in %.2fs", msg.version,
                        staged - t0, time.monotonic() - staged)
        except Exception as exc:
            logger.exception("streamed weights version %d failed", msg.version)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.loading == ("", msg.version):
                self.loading = None
        if self.metrics is not None:
            self.metrics.weight_loads.labels("stream", "error" if error else "ok").inc()
        await self.send(P.WeightsUpdated(msg.version, self.replica_id, error=error))
