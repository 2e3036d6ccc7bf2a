"""A watch on the rank's event loop: one callback holding it (an async agent that calls a blocking API,
``requests`` or the sync SDK or ``subprocess.run``, maybe against its own gateway) stops every session
of the rank and every timeout, with nothing in the logs. A thread notices the loop standing still
and logs where it stands, once per stall, so the culprit has a name."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Iterator

logger = logging.getLogger(__name__)


class LoopWatch:
    def __init__(self, threshold_s: float = 10.0, check_s: float = 1.0) -> None:
        self.threshold_s = threshold_s
        self.check_s = check_s
        self.beat = time.monotonic()
        self.stalls = 0
        """Stalls seen (each logged once)."""
        self._loop_thread = threading.get_ident()
        self._held = False
        self._stop = threading.Event()
        self._pulse: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._watch, name="loopwatch", daemon=True)

    async def __aenter__(self) -> LoopWatch:
        self._loop_thread = threading.get_ident()
        self._pulse = asyncio.create_task(self._beat(), name="loopwatch-pulse")
        self._thread.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._pulse is not None:
            self._pulse.cancel()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A stretch where the rank holds its loop on purpose (the step's gather and write, once its
        sessions are done): not a stall to report."""
        self._held = True
        try:
            yield
        finally:
            self.beat = time.monotonic()
            self._held = False

    async def _beat(self) -> None:
        while True:
            self.beat = time.monotonic()
            await asyncio.sleep(self.check_s / 2)

    def _watch(self) -> None:
        reported = False
        while not self._stop.wait(self.check_s):
            held = self._held  # read before the beat: held() renews the beat before it lets go
            lag = time.monotonic() - self.beat
            if lag < self.threshold_s or held:
                reported = False
                continue
            if reported:
                continue
            reported = True
            frame = sys._current_frames().get(self._loop_thread)
            where = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else "(not found)\n"
            logger.error("the rank's event loop has stood still for %.0fs: every session of this rank waits "
                         "(an async agent or environment calling a blocking API?). It is in:\n%s", lag, where)
            self.stalls += 1  # once logged: whoever waits on the count finds the report written
