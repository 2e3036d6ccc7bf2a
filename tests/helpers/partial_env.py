"""An environment for steps that close on a count: chosen sessions take their time (they are carried
across steps); the group rewards of ``toolkit.bench.partial.GroupRewards`` (filtered groups)."""

from __future__ import annotations

import asyncio
import os
import time

from toolkit.bench.partial import GroupRewards
from toolkit.rollout.envs import EnvStep
from toolkit.rollout.prompts import Prompt


class SlowSessions(GroupRewards):
    """Sessions named in ``slow`` (``"step/index"``) wait in their first tool call until the file
    ``until`` exists (a step report: the session is carried past that step, whatever the machine's
    speed), for at most ``sleep_s``; once per rank process (a restart of it runs at once)."""

    held: set[str] = set()

    def __init__(self, slow: tuple[str, ...] = (), until: str = "", sleep_s: float = 120.0, **kw: int) -> None:
        super().__init__(**kw)
        self.slow, self.until, self.sleep_s = set(slow), until, sleep_s
        self.key = ""

    async def reset(self, prompt: Prompt) -> list[int]:  # type: ignore[override]
        self.key = f"{prompt.metadata['step']}/{prompt.metadata['index']}"
        return super().reset(prompt)

    async def step(self, generated: list[int], finish_reason: str) -> EnvStep:  # type: ignore[override]
        if self.key in self.slow and self.turn == 0 and self.key not in SlowSessions.held:
            SlowSessions.held.add(self.key)
            deadline = time.monotonic() + self.sleep_s
            while not (self.until and os.path.exists(self.until)) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        return super().step(generated, finish_reason)
