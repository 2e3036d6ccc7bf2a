"""guard.bounded: a user's call bounded by workload.env_timeout_s, without swallowing anything else."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from toolkit.rollout import guard
from toolkit.rollout.guard import SessionTimeout, bounded


def test_a_call_past_its_timeout_is_cancelled_and_unwinds() -> None:
    unwound: list[str] = []

    async def hangs() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            unwound.append("finally")

    with pytest.raises(SessionTimeout):
        asyncio.run(bounded(hangs(), 0.05))
    assert unwound == ["finally"]


def test_the_users_own_timeout_error_stays_that_error() -> None:
    async def raises() -> None:
        raise TimeoutError("the tool's own")

    with pytest.raises(TimeoutError, match="the tool's own"):
        asyncio.run(bounded(raises(), 10))


def test_cancelling_the_caller_while_the_call_unwinds_cancels_the_caller() -> None:
    """The session is cancelled (its rank ends) while a timed-out call is still unwinding: the
    cancellation is the caller's, not turned into a session timeout."""

    async def slow_to_unwind() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(1)  # a slow cleanup
            raise

    async def main() -> BaseException | None:
        outer = asyncio.ensure_future(bounded(slow_to_unwind(), 0.05))
        await asyncio.sleep(0.3)  # past the timeout: bounded waits for the call to unwind
        outer.cancel()
        try:
            await outer
        except BaseException as e:  # noqa: BLE001 - what the caller sees is the point
            return e
        return None

    assert isinstance(asyncio.run(main()), asyncio.CancelledError)


def test_a_call_that_ignores_its_cancellation_is_left_behind(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(guard, "CANCEL_GRACE_S", 0.1)

    async def main() -> None:
        done = asyncio.Event()

        async def stubborn() -> None:
            while not done.is_set():
                try:
                    await asyncio.sleep(60)
                except asyncio.CancelledError:
                    continue  # swallowed: a user's bare except

        task = asyncio.ensure_future(bounded(stubborn(), 0.05))
        with pytest.raises(SessionTimeout):
            await task
        done.set()

    asyncio.run(main())


def test_an_exit_or_a_self_cancellation_in_the_users_call_fails_its_session_alone() -> None:
    """sys.exit() (argparse's too) or a CancelledError the user's code raises would otherwise leave the
    rank's event loop and end the rank, every other session with it."""

    async def exits() -> None:
        raise SystemExit(2)

    def exits_in_a_thread() -> None:
        raise SystemExit("usage: agent.py ...")

    async def cancels_itself() -> None:
        sub = asyncio.ensure_future(asyncio.sleep(60))
        sub.cancel()
        await sub  # raises CancelledError into the user's own call

    async def main() -> list[tuple[object, str]]:
        calls = [exits(), asyncio.to_thread(exits_in_a_thread), cancels_itself()]
        out = [await guard.guarded("agent", "s", call, 10) for call in calls]
        out.append(await guard.guarded("agent", "s", asyncio.sleep(0, "fine"), 10))  # the loop goes on
        return out

    assert asyncio.run(main()) == [
        (None, "agent raised SystemExit(2)"),
        (None, "agent raised SystemExit('usage: agent.py ...')"),
        (None, "agent cancelled itself (raised asyncio.CancelledError)"),
        ("fine", ""),
    ]


def test_sync_agents_that_hang_hold_only_their_own_threads() -> None:
    """More hung synchronous agents than the loop's shared pool has threads: later calls, and the
    rank's own work in that pool, still run; the rank's loop still ends."""
    release = threading.Event()
    hung = 40  # the shared pool has min(32, cores + 4) threads

    def hangs() -> str:
        release.wait(60)
        return "late"

    async def main() -> tuple[list[tuple[object, str]], object, object]:
        timed_out = [await guard.guarded("agent", f"s{i}", guard.in_own_thread(hangs), 0.01) for i in range(hung)]
        after = await guard.guarded("agent", "t", guard.in_own_thread(lambda: "answered"), 10)
        pool = await asyncio.wait_for(asyncio.to_thread(lambda: "pool free"), 10)
        return timed_out, after, pool

    try:
        timed_out, after, pool = asyncio.run(main())
    finally:
        release.set()
    assert {e for _, e in timed_out} == {"agent timed out after workload.env_timeout_s = 0.01s"}
    assert after == ("answered", "") and pool == "pool free"


def test_the_failure_budget_names_the_lowest_failed_sessions_whatever_order_they_ended_in() -> None:
    from toolkit.rollout.guard import FailureBudgetExceeded, check_failure_budget
    from toolkit.session.columns import pack
    from toolkit.session.sample import Sample

    samples = []
    for index in (7, 3, 9, 1, 5):  # the order the sessions ended in
        s = Sample.start(index, f"s{index}", [1, 2])
        if index != 3:
            s.mark("failed", f"boom {index}")
        samples.append(s)
    check_failure_budget(0, pack(samples, ["g"]), 0.9)  # 4 of 5 is within 0.9
    with pytest.raises(FailureBudgetExceeded) as exc:
        check_failure_budget(0, pack(samples, ["g"]), 0.5)
    assert str(exc.value).endswith("first errors: session 1: boom 1 | session 5: boom 5 | session 7: boom 7")


def test_a_sync_environment_that_hangs_is_bounded_and_never_holds_the_loop() -> None:
    import time

    ticks: list[int] = []

    def step() -> None:
        time.sleep(30)  # in its own daemon thread, abandoned at the timeout

    async def ticker() -> None:
        while True:
            ticks.append(1)
            await asyncio.sleep(0.01)

    async def main() -> tuple[object, str]:
        t = asyncio.ensure_future(ticker())
        try:
            return await guard.guarded("environment", "s", guard.user_call(step), 0.3)
        finally:
            t.cancel()

    assert asyncio.run(main()) == (None, "environment timed out after workload.env_timeout_s = 0.3s")
    assert len(ticks) > 1  # the loop ran the other tasks while the call hung


def test_a_toolkit_error_from_the_users_code_fails_its_session_not_the_rank() -> None:
    from toolkit.core.errors import RouterUnavailable, ToolkitError

    def step() -> None:
        raise RouterUnavailable("the user's code let a toolkit error through")

    async def also_async() -> None:
        raise RouterUnavailable("from an async method")

    async def main() -> list[tuple[object, str]]:
        return [await guard.guarded("environment", "s", guard.user_call(fn), 10, (ToolkitError,))
                for fn in (step, also_async)]

    assert asyncio.run(main()) == [
        (None, "environment raised RouterUnavailable: the user's code let a toolkit error through"),
        (None, "environment raised RouterUnavailable: from an async method"),
    ]

    async def toolkits_own() -> None:  # not through user_call: the toolkit's own failure ends every rank
        raise RouterUnavailable("router gone")

    with pytest.raises(RouterUnavailable):
        asyncio.run(guard.guarded("environment", "s", toolkits_own(), 10, (ToolkitError,)))


def test_token_ids_from_the_users_code_are_ids_or_a_clear_error() -> None:
    import numpy as np

    assert guard.token_ids(np.array([3, 0, 7], dtype=np.int64), "obs") == [3, 0, 7]
    ids = [5, 2**31 - 1, 0]
    assert guard.token_ids(ids, "obs") == ids and guard.token_ids(ids, "obs") is not ids  # its own list
    assert guard.token_ids(iter([9]), "obs") == [9]
    for garbage in ((4, True), b"abc", "abc", {1: 2}, iter([4, False])):  # text as ids, a dict's keys, bools
        with pytest.raises(guard.BadTokens):
            guard.token_ids(garbage, "obs")
    for bad, says in (([1.5], "must be a list of int token ids"), (["hi"], "must be a list of int token ids"),
                      ([1, -1], "holds token id -1, outside 0..2147483647"),
                      ([2**40], f"holds token id {2**40}, outside 0..2147483647"), (None, "must be a list")):
        with pytest.raises(guard.BadTokens, match=says):
            guard.token_ids(bad, "obs")


def test_a_timeout_says_how_much_of_the_session_went_to_the_engines() -> None:
    waits = guard.Waits()

    async def session() -> None:
        waits.begin()  # a turn's request, never answered
        await asyncio.sleep(60)

    _, error = asyncio.run(guard.guarded("environment", "s", session(), 0.2, waits=waits))
    assert error.startswith("environment timed out after workload.env_timeout_s = 0.2s (") and \
        error.endswith("s of it waiting for the engines)"), error


def test_any_base_exception_or_stop_iteration_from_the_users_code_fails_its_session_alone() -> None:
    """asyncio lets KeyboardInterrupt out of the event loop and a BaseException of a library's own past
    every ``except Exception``; a future refuses StopIteration (the session would wait for its timeout)."""

    class Abandon(BaseException):
        pass

    async def interrupts() -> None:
        raise KeyboardInterrupt

    async def abandons() -> None:
        raise Abandon("gevent-style")

    def exhausted() -> None:
        next(iter(()))

    async def main() -> list[tuple[object, str]]:
        out = [await guard.guarded("environment", "s", call, 30)
               for call in (interrupts(), abandons(), guard.user_call(exhausted), guard.user_call(lambda: 3))]
        out.append(await guard.guarded("environment", "s", asyncio.sleep(0, "fine"), 10))
        return out

    got = asyncio.run(main())
    assert got[0] == (None, "environment raised KeyboardInterrupt: ")
    assert got[1] == (None, "environment raised Abandon: gevent-style")
    assert got[2][0] is None and "StopIteration" in got[2][1] and "timed out" not in got[2][1]
    assert got[3:] == [(3, ""), ("fine", "")]


def test_a_reward_is_a_finite_number_and_the_budget_counts_only_sessions_that_count() -> None:
    from toolkit.rollout.guard import FailureBudgetExceeded, check_failure_budget
    from toolkit.session.columns import pack
    from toolkit.session.sample import Sample

    assert guard.finite_reward(1) == 1.0 and guard.finite_reward(np.float32(0.5)) == 0.5
    for bad in (float("nan"), float("inf"), np.array([1.0]), 1 + 2j, True, "1", None):
        with pytest.raises(guard.BadReward):
            guard.finite_reward(bad)
    samples = []
    for index in range(50):  # 5 failed of the 10 that count; 40 stale rows count for nothing
        s = Sample.start(index, f"s{index}", [1, 2])
        if index < 5:
            s.mark("failed", "boom")
        elif index >= 10:
            s.mark("stale", "dropped")
        samples.append(s)
    with pytest.raises(FailureBudgetExceeded, match="5 of 10 sessions failed"):
        check_failure_budget(0, pack(samples, ["g"]), 0.1)
