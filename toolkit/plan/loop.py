"""An asyncio event loop in virtual time: when nothing is ready it jumps to its next timer instead of
waiting, so sleeps, timeouts and ``call_later`` cost no wall time. It has no file descriptors: a twin
has no sockets and no threads."""

from __future__ import annotations

import asyncio
import selectors
from typing import Any

from toolkit.core.errors import ToolkitError


class Stalled(ToolkitError):
    """Nothing is ready and no timer is set: whatever waits would wait forever."""


class _Selector(selectors.BaseSelector):
    def __init__(self, loop: VirtualLoop) -> None:
        self.loop = loop

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        raise RuntimeError("a virtual-time loop has no file descriptors to watch")

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        raise KeyError(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Stalled("the twin stalled: tasks wait, but no event is due (nothing would ever wake them)")
        self.loop.now += max(0.0, timeout)
        return []

    def get_map(self) -> dict[Any, selectors.SelectorKey]:
        return {}


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 0.0
        """Virtual seconds since the loop began."""
        super().__init__(selector=_Selector(self))
        self._clock_resolution = 1e-9
        self.failure: BaseException | None = None
        """The first exception a callback raised: it ends the run (:meth:`run`)."""
        self.set_exception_handler(self._failed)

    def _failed(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if self.failure is None:
            self.failure = context.get("exception") or RuntimeError(context.get("message", "a callback failed"))
        self.stop()

    def run(self, main: Any) -> Any:
        """Run the coroutine ``main`` to its end; a callback that raised ends it with that exception."""
        try:
            return self.run_until_complete(main)
        except RuntimeError:
            if self.failure is not None:
                raise self.failure from None
            raise

    def time(self) -> float:
        return self.now

    # No self-pipe: nothing wakes the loop from another thread.
    def _make_self_pipe(self) -> None:
        pass

    def _close_self_pipe(self) -> None:
        pass

    def _write_to_self(self) -> None:
        pass
