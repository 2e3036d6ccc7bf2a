"""What keeps a user's environment or agent from taking a run down: each session's call bounded by
``workload.env_timeout_s`` and its failure kept to its own sample, and the user's failure budget
(``rollout.max_failed_fraction``), the one user-set limit that ends every rank."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import operator
import threading
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import numpy as np

from toolkit.core import clock
from toolkit.core.errors import Terminated, ToolkitError
from toolkit.core.tokens import ids_below
from toolkit.session.columns import Columns, final_rows
from toolkit.session.sample import SAMPLE_STATUSES

UNCOUNTED = [SAMPLE_STATUSES.index("stale"), SAMPLE_STATUSES.index("filtered")]
"""Row statuses written but never counted: not in a failure budget's sessions either."""

logger = logging.getLogger(__name__)


CANCEL_GRACE_S = 5.0
"""How long a timed-out environment or agent call gets to unwind once cancelled."""


class SessionTimeout(Exception):
    """A session's environment or agent ran past ``workload.env_timeout_s``."""


class CallEscaped(Exception):
    """The user's call raised what is not an Exception (``sys.exit()``, argparse's exit) or cancelled
    itself: its session fails like any other error, rather than the exit or the cancellation
    leaving the rank's event loop."""


class UserCodeFailed(Exception):
    """The user's environment code raised: its session fails whatever the error's class, a
    ToolkitError it let through included (from the toolkit's own calls one ends every rank)."""


class BadTokens(ValueError):
    """The user's environment returned token ids that are not ids."""


class BadReward(ValueError):
    """The user's environment or agent gave a reward that is not a finite number."""


def finite_reward(value: Any) -> float:
    """``value`` as a reward, or :class:`BadReward`: a bool, an array, a complex or a NaN would fail the
    step's packing, spoil its group's statistics or break a GRPO filter, past any one session."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadReward(f"the reward must be a finite number, got {type(value).__name__} {value!r:.80}")
    reward = float(value)
    if not math.isfinite(reward):
        raise BadReward(f"the reward must be a finite number, got {reward}")
    return reward


TOKEN_ID_LIMIT = 1 << 31
"""Token ids are stored as int32 (``columns.LIST_COLUMNS``)."""


def token_ids(values: Any, what: str) -> list[int]:
    """``values`` as token ids, or :class:`BadTokens` naming what is wrong: a float, a string or an id
    outside the int32 range would otherwise fail later, in the router (which could not even read the
    request) or in the rank's packing of the step, past any one session."""
    try:  # a list of plain ints in range, the usual answer, in one C-level pass
        return msgspec.convert((values,), ids_below(TOKEN_ID_LIMIT)).ids
    except msgspec.ValidationError:
        pass  # anything else (numpy ints, bools, a bad id) as below, with its message
    if isinstance(values, str | bytes | bytearray | Mapping):  # iterable, but not ids: text, a dict's keys
        raise BadTokens(f"{what} must be a list of int token ids, not a {type(values).__name__}")
    try:
        items = list(values)
        ids = [operator.index(t) for t in items]
    except TypeError as exc:
        raise BadTokens(f"{what} must be a list of int token ids: {exc}") from None
    if any(isinstance(t, bool) for t in items):
        raise BadTokens(f"{what} must be a list of int token ids: it holds a bool")
    bad = next((t for t in ids if not 0 <= t < TOKEN_ID_LIMIT), None)
    if bad is not None:
        raise BadTokens(f"{what} holds token id {bad}, outside 0..{TOKEN_ID_LIMIT - 1}")
    return ids


async def _contained(awaitable: Any) -> Any:
    # Inside the task: asyncio lets a SystemExit out of the event loop at once, past every caller.
    try:
        return await awaitable
    except Terminated:
        raise  # SIGTERM, whatever code it interrupted: the rank ends
    except SystemExit as exc:
        raise CallEscaped(f"raised SystemExit({exc.code!r})") from None
    except (Exception, asyncio.CancelledError):
        raise  # the session's own judgement (a cancellation: its timeout's, or the rank's)
    except BaseException as exc:  # KeyboardInterrupt, GeneratorExit, a library's own: asyncio would end the rank
        raise CallEscaped(f"raised {type(exc).__name__}: {exc}") from None


async def in_own_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` (the user's synchronous agent or environment method) in a daemon thread of its
    own. A call abandoned at its timeout keeps running there: in the loop's shared pool
    (``asyncio.to_thread``) a few such calls would take every thread the rank's later sessions and
    weight loads need, and the rank would wait for them at exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, exc: BaseException | None) -> None:
        if fut.done():  # abandoned: nobody waits for it any more
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    def run() -> None:
        try:
            value, exc = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting session, which judges it
            value, exc = None, e
            if isinstance(e, StopIteration | StopAsyncIteration):  # a future refuses them: it would never settle
                exc = RuntimeError(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # the loop has closed: the rank is past this session
            pass

    threading.Thread(target=run, name=f"user-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await fut


async def user_call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, a method of the user's environment: awaited if async, else in a daemon thread of
    its own, as a synchronous agent runs (on the loop's thread a call that hangs would hold every
    session of the rank, and ``workload.env_timeout_s`` could never fire). Whatever it raises
    becomes :class:`UserCodeFailed`."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        return await maybe_await(await in_own_thread(fn, *args))
    except Exception as exc:
        raise UserCodeFailed(f"raised {type(exc).__name__}: {exc}") from exc


async def inline_call(fn: Callable[..., Any], *args: Any) -> Any:
    """:func:`user_call` on the loop's own thread (the fleet twin's: a thread would return at a virtual
    time nobody chose). A call that hangs holds the loop."""
    try:
        value = fn(*args)
        return (await value) if inspect.isawaitable(value) else value  # (maybe_await's, without its coroutine)
    except Exception as exc:
        raise UserCodeFailed(f"raised {type(exc).__name__}: {exc}") from exc


async def bounded(awaitable: Any, timeout_s: float | None) -> Any:
    """``awaitable``'s result, cancelling it after ``timeout_s`` (SessionTimeout). Unlike wait_for,
    a TimeoutError the user's own code raises stays that error, not a session timeout."""
    task = asyncio.ensure_future(_contained(awaitable))
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        # Give the cancelled call a moment to unwind (its finally blocks, its sockets) without taking
        # on what it raises; a cancellation of this task itself still propagates from here, and a call
        # that ignores its cancellation is left behind rather than holding the session.
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        if not task.done():
            logger.warning("a timed-out call ignored its cancellation for %ss; left running", CANCEL_GRACE_S)
        elif not task.cancelled():
            task.exception()  # retrieved: not logged as never retrieved
        raise SessionTimeout
    if task.cancelled():  # nobody here cancelled it: the user's code raised CancelledError itself
        raise CallEscaped("cancelled itself (raised asyncio.CancelledError)")
    return task.result()


class FailureBudgetExceeded(ToolkitError):
    """More of a step's sessions failed than ``rollout.max_failed_fraction`` allows."""


async def maybe_await(value: Any) -> Any:
    """An environment's answer, awaited if it is async (a slow tool never blocks the other sessions)."""
    return await value if inspect.isawaitable(value) else value


class Waits:
    """A session's time waiting for the engines (the bound counts it with the user's own)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.since: float | None = None

    def begin(self) -> None:
        self.since = clock.monotonic()

    def end(self) -> None:
        if self.since is not None:
            self.total_s += clock.monotonic() - self.since
            self.since = None

    def seconds(self) -> float:
        return self.total_s + (clock.monotonic() - self.since if self.since is not None else 0.0)


async def guarded(what: str, sid: str, awaitable: Any, timeout: float | None,
                  fatal: tuple[type[BaseException], ...] = (), waits: Waits | None = None) -> tuple[Any, str]:
    """The user's environment or agent for one session, bounded by ``workload.env_timeout_s``:
    (its result, "") or (None, why it failed); its failure is the session's alone. ``fatal``
    errors pass through: they end every rank. ``waits``: the session's time in the engines, which
    a timeout's error tells apart from the user's own."""
    try:
        return await bounded(awaitable, timeout), ""
    except SessionTimeout:
        spent = f" ({waits.seconds():.1f}s of it waiting for the engines)" if waits is not None else ""
        return None, f"{what} timed out after workload.env_timeout_s = {timeout}s{spent}"
    except (CallEscaped, UserCodeFailed) as exc:
        logger.warning("session %s: %s %s", sid, what, exc)
        return None, f"{what} {exc}"
    except fatal:
        raise
    except Exception as exc:
        logger.warning("session %s: %s failed: %r", sid, what, exc)
        return None, f"{what} raised {type(exc).__name__}: {exc}"


def check_failure_budget(step: int, cols: Columns, budget: float | None) -> None:
    """The user's failure budget: past it every rank ends (the step's files are written first)."""
    final = final_rows(cols) & ~np.isin(cols["status"], UNCOUNTED)  # stale and filtered rows count for nothing
    failed_rows = final & (cols["status"] == SAMPLE_STATUSES.index("failed"))
    failed, rows = int(failed_rows.sum()), int(final.sum())
    if budget is None or not rows or failed / rows <= budget:
        return
    errors = ""
    if "error" in cols:  # rollout.output=gather: the errors are here; shards: in the shard files
        lens = cols["error__len"]
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        bad = np.flatnonzero(failed_rows)
        bad = bad[np.argsort(cols["index"][bad], kind="stable")][:3]  # rows come as sessions ended
        texts = [bytes(cols["error"][starts[i]:starts[i] + lens[i]]).decode(errors="replace") for i in bad]
        errors = "; first errors: " + " | ".join(f"session {int(cols['index'][i])}: {t}" for i, t in zip(bad, texts, strict=True))
    raise FailureBudgetExceeded(
        f"step {step}: {failed} of {rows} sessions failed ({failed / rows:.1%}), more than "
        f"rollout.max_failed_fraction = {budget}{errors}")
