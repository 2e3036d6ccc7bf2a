"""The requests a vLLM engine runs now, and the aborts asked of them. vLLM drops an abort of a request it
has not registered yet (``AsyncLLM.generate`` prepares a request's input in a thread pool before its
output processor knows the id: a few ms, longer on a busy host), so an abort is asked again until the
request it was meant for has ended."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

ABORT_AGAIN_S = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""Seconds before each new ask of an abort whose request still runs; then every last one of them."""


class LiveRequests:
    """Request ids in the engine now, each with its attempt (an id may run again after it ended: an abort
    asked of the first attempt never reaches the second)."""

    def __init__(self) -> None:
        self._live: dict[str, object] = {}
        self._aborting: set[asyncio.Task[None]] = set()

    def begin(self, rid: str) -> object:
        attempt = self._live[rid] = object()
        return attempt

    def end(self, rid: str, attempt: object) -> None:
        if self._live.get(rid) is attempt:
            del self._live[rid]

    def __contains__(self, rid: object) -> bool:
        return rid in self._live

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._live))

    def __len__(self) -> int:
        return len(self._live)

    def abort(self, rid: str, ask: Callable[[str], Awaitable[None]]) -> None:
        """Ask ``ask(rid)`` again while the attempt now running under ``rid`` runs (once asked already)."""
        attempt = self._live.get(rid)
        if attempt is None:
            return
        task = asyncio.get_running_loop().create_task(self._again(rid, attempt, ask))
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)

    async def _again(self, rid: str, attempt: object, ask: Callable[[str], Awaitable[None]]) -> None:
        k = 0
        while True:
            await asyncio.sleep(ABORT_AGAIN_S[min(k, len(ABORT_AGAIN_S) - 1)])
            if self._live.get(rid) is not attempt:
                return
            try:
                await ask(rid)
            except Exception:  # the engine is going: its requests end with it
                return
            k += 1

    def close(self) -> None:
        for task in list(self._aborting):
            task.cancel()
