"""Rank 0's side of the trainer handshake: which weights each step runs on.

Before step ``s`` (``rollout.max_staleness = k``) it waits until weights of version ``>= s - k`` are
published in ``rollout.weights_dir`` and has every replica load the latest one up to ``s``; while the
step runs it loads, at once, any newer one up to ``s`` the trainer publishes meanwhile (the replicas
take it as ``rollout.update_mode`` says, aborting nothing). The step report's ``weights`` entry says
what the step started on, how long it waited, and each update that landed while it ran.

With ``rollout.weights_transport=stream`` the trainer sends the weights itself (``toolkit.weights.Streamer``):
rank 0 loads nothing, it waits until the router says version ``>= s - k`` has reached the replicas
(``Status.weights_version``) and follows the versions that land while the step runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolkit import weights
from toolkit.client import RouterClient
from toolkit.config import RolloutConfig, WeightsTransport
from toolkit.core.errors import RouterUnavailable

logger = logging.getLogger(__name__)


class StepWeights:
    def __init__(self, cfg: RolloutConfig, client: RouterClient, stop: Callable[[], bool]) -> None:
        self.cfg = cfg
        self.client = client
        self.stop = stop
        """Launch asked the run to stop: a wait for weights ends."""
        self.held: tuple[str | None, int] | None = None
        """The checkpoint the replicas hold (None: not known yet; the first step loads the latest)."""
        self.steps: dict[int, dict[str, Any]] = {}

    async def before(self, step: int) -> bool:
        """Wait for the weights ``step`` needs and have the replicas load the latest published up to
        ``step`` if it is newer than theirs (the first step of a run, resumed or not, loads the latest:
        its replicas are fresh). False: launch asked to stop meanwhile."""
        r = self.cfg
        t0 = time.monotonic()
        need = step - r.max_staleness if r.max_staleness is not None else 0
        if r.weights_transport == WeightsTransport.stream:
            return await self._before_streamed(step, need, t0)
        if r.weights_dir and need > 0:
            ckpt = await weights.wait_for_version(
                r.weights_dir,
                need,
                step,
                r.weights_timeout_s,
                poll_s=r.weights_poll_s,
                stop=self.stop,
                why=f"step {step} needs weights at most rollout.max_staleness = {r.max_staleness} behind: ",
            )
            if ckpt is None:
                return False
        else:
            ckpt = await asyncio.to_thread(weights.latest, r.weights_dir, step)
        waited = time.monotonic() - t0
        load_s = await self._load(step, ckpt) if ckpt is not None and self._newer(ckpt) else 0.0
        path, version = self.held if self.held is not None else (None, 0)
        self.held = (path, version)
        self.steps[step] = {
            "version": version,
            "path": path,
            "waited_s": waited,
            "load_s": load_s,
            "updates": [],
        }
        return True

    async def _streamed(self) -> int:
        """The newest streamed version every replica it went to has (0: the model's own)."""
        try:
            return max(0, (await self.client.status()).weights_version)
        except RouterUnavailable as exc:
            logger.warning("the router did not say which weights its replicas hold: %s", exc)
            return self.held[1] if self.held is not None else 0

    async def _before_streamed(self, step: int, need: int, t0: float) -> bool:
        version = await self._streamed()
        logged = False
        while version < need:
            if self.stop():
                return False
            if time.monotonic() - t0 > self.cfg.weights_timeout_s:
                raise weights.WeightsTimeout(
                    f"step {step} needs weights version >= {need} (rollout.max_staleness = {self.cfg.max_staleness}): "
                    f"the replicas hold version {version} after {self.cfg.weights_timeout_s:g}s "
                    "(rollout.weights_timeout_s); is the trainer streaming (toolkit.weights.Streamer)?")
            if not logged:
                logger.info("step %d waits for streamed weights version %d (the replicas hold %d)", step, need, version)
                logged = True
            await asyncio.sleep(self.cfg.weights_poll_s)
            version = await self._streamed()
        self.held = (None, version)
        self.steps[step] = {"version": version, "path": None, "waited_s": time.monotonic() - t0, "load_s": 0.0,
                            "updates": []}
        return True

    async def follow(self, step: int, done: asyncio.Event) -> None:
        """While ``step`` runs (until ``done``): load a checkpoint up to ``step`` as soon as it is
        published, so a step that began behind goes on with the newest weights there are. A load under
        way when ``done`` is set is finished: the step report lists every version its rows may hold."""
        t0 = time.monotonic()
        while not done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), self.cfg.weights_poll_s)
            if done.is_set():
                return
            if self.cfg.weights_transport == WeightsTransport.stream:
                version = await self._streamed()
                if self.held is not None and version > self.held[1]:
                    self.held = (None, version)
                    self.steps[step]["updates"].append(
                        {"version": version, "path": None, "at_s": time.monotonic() - t0, "load_s": 0.0})
                continue
            ckpt = await asyncio.to_thread(weights.latest, self.cfg.weights_dir, step)
            if ckpt is not None and self._newer(ckpt):
                at = time.monotonic() - t0
                load_s = await self._load(step, ckpt)
                self.steps[step]["updates"].append(
                    {"version": ckpt[1], "path": str(ckpt[0]), "at_s": at, "load_s": load_s}
                )

    def report(self, step: int) -> dict[str, Any] | None:
        """The step report's ``weights``: version and path it began on, ``waited_s``, ``load_s``, and
        ``updates`` (``version``, ``path``, ``at_s`` into the step, ``load_s``) loaded while it ran."""
        return self.steps.pop(step, None)

    def _newer(self, ckpt: tuple[Path, int]) -> bool:
        # On the model's own weights (no path) any published checkpoint is newer, version 0 included.
        return self.held is None or self.held[0] is None or ckpt[1] > self.held[1]

    async def _load(self, step: int, ckpt: tuple[Path, int]) -> float:
        """Every replica loads ``ckpt``; returns how long that took."""
        t0 = time.monotonic()
        await self.client.update_weights(str(ckpt[0]), ckpt[1], timeout_s=self.cfg.load_timeout_s)
        load_s = time.monotonic() - t0
        self.held = (str(ckpt[0]), ckpt[1])
        logger.info("step %d: weights version %d loaded from %s in %.2fs", step, ckpt[1], ckpt[0], load_s)
        return load_s
