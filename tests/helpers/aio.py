"""asyncio in tests: run a coroutine with a bound, talk to a run's router through a RouterClient."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from toolkit.client import RouterClient
from toolkit.core.rundir import RunDir

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
    """``asyncio.run`` of ``coro``, failing with TimeoutError after ``timeout_s``."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def with_client(rd: RunDir, fn: Callable[[RouterClient], Awaitable[T]], timeout_s: float = 90.0) -> T:
    """Run ``fn(client)`` with a connected RouterClient of the run, bounded by ``timeout_s``."""
    c = RouterClient(rd)
    await c.connect(10)
    try:
        return await asyncio.wait_for(fn(c), timeout_s)
    finally:
        await c.close()
