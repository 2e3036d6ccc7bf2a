"""The rank's loop watch: a callback that holds the event loop is logged once, with where it is."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from toolkit.rollout.loopwatch import LoopWatch


def blocking_agent_call() -> None:
    time.sleep(1.5)  # what requests.post or the sync SDK does inside an async agent


def test_a_blocked_loop_is_logged_once_naming_the_blocking_call(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> int:
        async with LoopWatch(threshold_s=0.3, check_s=0.1) as watch:
            await asyncio.sleep(0.5)  # a loop that runs: nothing logged
            assert watch.stalls == 0
            blocking_agent_call()
            await asyncio.sleep(0.5)
            return watch.stalls

    with caplog.at_level(logging.ERROR, logger="toolkit.rollout.loopwatch"):
        assert asyncio.run(body()) == 1
    [record] = caplog.records
    assert "stood still" in record.getMessage() and "blocking_agent_call" in record.getMessage()
