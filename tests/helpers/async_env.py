"""An ``async`` environment whose tool takes its time: the rank must run other sessions meanwhile."""

from __future__ import annotations

import asyncio

from toolkit.rollout.envs import EnvStep, ToolCallEnv
from toolkit.rollout.prompts import Prompt


class SlowToolEnv(ToolCallEnv):
    """``ToolCallEnv`` with an awaited 0.2 s tool; the reward is how many sessions of this rank were
    inside the tool at once (at least 2 only if a slow tool does not block the others)."""

    inside = 0
    most = 0

    async def reset(self, prompt: Prompt) -> list[int]:  # type: ignore[override]
        await asyncio.sleep(0)
        return super().reset(prompt)

    async def step(self, generated: list[int], finish_reason: str) -> EnvStep:  # type: ignore[override]
        cls = type(self)
        cls.inside += 1
        cls.most = max(cls.most, cls.inside)
        try:
            await asyncio.sleep(0.2)
        finally:
            cls.inside -= 1
        out = super().step(generated, finish_reason)
        out.reward = float(cls.most)
        return out
