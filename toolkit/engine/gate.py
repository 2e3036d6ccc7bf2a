"""The gate in front of a replica's engine: requests pass it into the engine unless it is closed (a weight
update, an engine restart), and it knows which requests are in the engine and the weight versions
each of them saw there (for engines that keep no account of their own)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Gate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._lock = asyncio.Lock()
        self.entered: set[str] = set()
        """Requests in the engine now."""
        self._versions: dict[str, list[int]] = {}

    def is_open(self) -> bool:
        return self._open.is_set()

    async def enter(self, rid: str, version: int) -> None:
        """Wait until the gate is open, then count ``rid`` as in the engine, on weights ``version``."""
        await self._open.wait()
        self.entered.add(rid)
        self._versions[rid] = [version]
        self._idle.clear()

    def leave(self, rid: str) -> list[int]:
        """``rid`` left the engine: the versions it saw there."""
        self.entered.discard(rid)
        if not self.entered:
            self._idle.set()
        return self._versions.pop(rid, [])

    def switched(self, version: int) -> None:
        """The requests in the engine go on with ``version``'s weights."""
        for rid in self.entered:
            seen = self._versions.get(rid)
            if seen is not None and seen[-1] != version:
                seen.append(version)

    @contextlib.asynccontextmanager
    async def closed(self) -> AsyncIterator[None]:
        """New requests wait at the gate; the ones in the engine stay (one holder at a time)."""
        async with self._lock:
            self._open.clear()
            try:
                yield
            finally:
                self._open.set()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """The engine to itself: the gate closed and no request in the engine."""
        async with self.closed():
            await self._idle.wait()
            yield
