"""The rank's loop watch: a callback that holds the event loop is logged once, with where it is."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from toolkit.rollout.loopwatch import LoopWatch


def blocking_agent_call(watch: LoopWatch) -> None:
    """What requests.post or the sync SDK does inside an async agent: it holds the loop (here until the
    watch has noticed, so the test waits on that, not on a duration)."""
    deadline = time.monotonic() + 60
    while watch.stalls == 0 and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_blocked_loop_is_logged_once_naming_the_blocking_call(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> int:
        # A threshold far above any pause of a running loop, even on a loaded machine.
        async with LoopWatch(threshold_s=3.0, check_s=0.1) as watch:
            await asyncio.sleep(0.5)  # a loop that runs: nothing logged
            assert watch.stalls == 0
            blocking_agent_call(watch)
            await asyncio.sleep(0.5)
            return watch.stalls

    with caplog.at_level(logging.ERROR, logger="toolkit.rollout.loopwatch"):
        assert asyncio.run(body()) == 1
    [record] = caplog.records
    assert "stood still" in record.getMessage() and "blocking_agent_call" in record.getMessage()


def test_a_loop_held_on_purpose_is_not_a_stall(caplog: pytest.LogCaptureFixture) -> None:
    """The rank holds its loop for the step's gather and write (its sessions are done): not reported,
    and the watch goes on after it."""
    async def body() -> int:
        async with LoopWatch(threshold_s=0.3, check_s=0.05) as watch:
            with watch.held():
                time.sleep(1.0)  # the step's gather and Parquet write
            await asyncio.sleep(0.2)
            stalls = watch.stalls
            blocking_agent_call(watch)  # a real stall after it is still seen
            return stalls

    with caplog.at_level(logging.ERROR, logger="toolkit.rollout.loopwatch"):
        assert asyncio.run(body()) == 0
    assert len(caplog.records) == 1
