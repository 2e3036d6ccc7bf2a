"""An asyncio event loop in virtual time: when nothing is ready it jumps to its next timer instead of
waiting, so sleeps, timeouts and ``call_later`` cost no wall time. It has no file descriptors: a twin
has no sockets and no threads."""

from __future__ import annotations

import asyncio
import heapq
import selectors
from asyncio import base_events
from typing import Any

from toolkit.core.errors import ToolkitError

FAR_S = 60.0
"""Virtual seconds: a timer set to fire this far ahead or more waits in the far heap (``VirtualLoop._far``)."""


class Stalled(ToolkitError):
    """Nothing is ready and no timer is set: whatever waits would wait forever."""


class _Selector(selectors.BaseSelector):
    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        raise RuntimeError("a virtual-time loop has no file descriptors to watch")

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        raise KeyError(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        raise RuntimeError("a virtual-time loop waits for nothing: its iteration moves its clock")

    def get_map(self) -> dict[Any, selectors.SelectorKey]:
        return {}


class _Timer(asyncio.TimerHandle):
    """A timer of the twin's own machinery (:meth:`VirtualLoop.at`): :meth:`VirtualLoop._run_once` runs
    it as a plain call, with no context copied for it and entered (none of that machinery reads a
    context variable)."""

    __slots__ = ()

    def __init__(self, when: float, callback: Any, args: tuple[Any, ...], loop: VirtualLoop) -> None:
        self._callback = callback
        self._args = args
        self._cancelled = False
        self._loop = loop
        self._source_traceback = None
        self._repr = None
        self._context = None
        self._when = when
        self._scheduled = False

    def cancel(self) -> None:
        """As TimerHandle's (the loop counts it among the cancelled while it is in the heap), in one call."""
        if not self._cancelled:
            if self._scheduled:
                self._loop._timer_cancelled_count += 1  # type: ignore[attr-defined]
            self._cancelled = True
            self._callback = self._args = None


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.now = 0.0
        """Virtual seconds since the loop began."""
        super().__init__(selector=_Selector())
        self._clock_resolution = 1e-9
        self._timers = 0
        """Timers set so far: the order of those due at the same time."""
        self._far: list[tuple[float, int, asyncio.TimerHandle]] = []
        """Timers due :data:`FAR_S` or more past the time they were set (every session's timeout): a heap
        of their own, taken into the near one as the clock comes within ``FAR_S`` of them, so that
        the timers that fire (engine steps, heartbeats) are popped from a heap of thousands, not of
        every session's timeout (65,536 in a step of as many sessions)."""
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

    def soon(self, callback: Any, *args: Any) -> None:
        """``call_soon`` for the twin's own machinery (its links, its engines): the same turn of the loop
        and order, as a plain call: no handle (it cannot be cancelled) and no copy of the context
        (asyncio's tasks, futures and the user's code keep ``call_soon``)."""
        if self._closed:  # (asyncio's _check_closed, without its call)
            raise RuntimeError("Event loop is closed")
        self._ready.append((callback, args))

    # asyncio's timers and loop iteration, with the heap holding (when, n, handle): compared in C, where
    # TimerHandle compares in Python (a twin of thousands of replicas keeps tens of thousands of timers),
    # and timers due at the same time run in the order they were set.
    def call_at(self, when: float, callback: Any, *args: Any, context: Any = None) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        return self._set(asyncio.TimerHandle(when, callback, args, self, context))

    def at(self, when: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        """``call_at`` for the twin's own machinery, as :meth:`soon` is ``call_soon``: the same heap and
        order, without a copy of the context."""
        return self._set(_Timer(when, callback, args, self))

    def later(self, delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        """:meth:`at` ``delay`` seconds from now (``call_later``)."""
        return self._set(_Timer(self.now + delay, callback, args, self))

    def _set(self, timer: asyncio.TimerHandle) -> asyncio.TimerHandle:
        if self._closed:
            raise RuntimeError("Event loop is closed")
        self._timers += 1
        when = timer._when
        heapq.heappush(self._scheduled if when < self.now + FAR_S else self._far, (when, self._timers, timer))
        timer._scheduled = True
        return timer

    def _run_once(self) -> None:
        # Invariant: every near timer is due before now + FAR_S (it was set so, and the clock only goes
        # on) and, once the far ones so due are taken in, every far timer is due after: the near heap's
        # first is the first of all (ties: the order they were set in, kept in each entry).
        far = self._far
        if far and far[0][0] < self.now + FAR_S:
            self._take_far()
        scheduled: list[tuple[float, int, asyncio.TimerHandle]] = self._scheduled
        n = len(scheduled) + len(far)
        if (n > base_events._MIN_SCHEDULED_TIMER_HANDLES
                and self._timer_cancelled_count / n > base_events._MIN_CANCELLED_TIMER_HANDLES_FRACTION):
            self._scheduled = scheduled = self._drop_cancelled(scheduled)
            self._far = far = self._drop_cancelled(far)
            self._timer_cancelled_count = 0
        else:
            while scheduled and scheduled[0][2]._cancelled:
                self._timer_cancelled_count -= 1
                heapq.heappop(scheduled)[2]._scheduled = False
        ready = self._ready
        if not ready and not self._stopping:
            if scheduled:
                first = scheduled[0][0]
            else:
                while far and far[0][2]._cancelled:
                    self._timer_cancelled_count -= 1
                    heapq.heappop(far)[2]._scheduled = False
                if not far:
                    raise Stalled("the twin stalled: tasks wait, but no event is due (nothing would ever wake them)")
                first = far[0][0]
            # What the selector's wait would be: up to the next timer.
            self.now += max(0.0, min(max(0, first - self.now), base_events.MAXIMUM_SELECT_TIMEOUT))
            if far and far[0][0] < self.now + FAR_S:  # (those now due within FAR_S: the invariant again)
                self._take_far()
        end = self.now + self._clock_resolution
        while scheduled and scheduled[0][0] < end:
            handle = heapq.heappop(scheduled)[2]
            handle._scheduled = False
            ready.append(handle)
        for _ in range(len(ready)):
            handle = ready.popleft()
            kind = handle.__class__
            if kind is tuple:  # soon's (callback, args)
                callback, args = handle
            elif handle._cancelled:
                continue
            elif kind is _Timer:
                callback, args = handle._callback, handle._args
            else:  # asyncio's own handles: in their context
                handle._run()
                continue
            try:  # the twin's own: a plain call, failing as asyncio's handles do
                callback(*args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self.call_exception_handler({"message": f"Exception in callback {callback!r}", "exception": exc})

    def _take_far(self) -> None:
        """Far timers due before now + :data:`FAR_S` into the near heap."""
        far, near, edge = self._far, self._scheduled, self.now + FAR_S
        while far and far[0][0] < edge:
            heapq.heappush(near, heapq.heappop(far))

    @staticmethod
    def _drop_cancelled(heap: list[tuple[float, int, asyncio.TimerHandle]]) -> list[tuple[float, int, asyncio.TimerHandle]]:
        kept = []
        for entry in heap:
            if entry[2]._cancelled:
                entry[2]._scheduled = False
            else:
                kept.append(entry)
        heapq.heapify(kept)
        return kept

    # No self-pipe: nothing wakes the loop from another thread.
    def _make_self_pipe(self) -> None:
        pass

    def _close_self_pipe(self) -> None:
        pass

    def _write_to_self(self) -> None:
        pass
