"""Where the router and the rollout sessions read the time: the real clocks, or the virtual one of the
fleet twin (``toolkit.plan``), which runs the same code in virtual time.

Call them through the module (``clock.wall()``, ``clock.monotonic()``): :func:`virtual` rebinds them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

wall: Callable[[], float] = time.time
"""Seconds since the epoch (``time.time`` outside a twin)."""
monotonic: Callable[[], float] = time.monotonic
"""A clock that never goes back (``time.monotonic`` outside a twin)."""


@contextlib.contextmanager
def virtual(now: Callable[[], float], epoch: float) -> Iterator[None]:
    """Within it both clocks read ``now()`` (virtual seconds), the wall clock offset by ``epoch``. One
    twin at a time, on one thread: the router and the sessions it drives read the same time."""
    global wall, monotonic
    if wall is not time.time:
        raise RuntimeError("a virtual clock is already in use (one twin runs at a time)")
    wall, monotonic = (lambda: epoch + now()), now
    try:
        yield
    finally:
        wall, monotonic = time.time, time.monotonic
