"""An environment that takes its rank down in one chosen session of one chosen step: for "ranks fail
loudly together". An ``Exception`` from an environment only fails its sample; a ``BaseException`` that
is not one (what ``sys.exit`` or an interpreter-level failure raises) is the rank's own failure."""

from __future__ import annotations

from toolkit.rollout.envs import EnvStep, SingleTurnEnv
from toolkit.rollout.prompts import Prompt


class RankDown(BaseException):
    """Not an environment error: the process itself is going."""


class CrashAt(SingleTurnEnv):
    def __init__(self, step: int = 0, index: int = 0) -> None:
        super().__init__()
        self.crash = (step, index)
        self.at = (-1, -1)

    def reset(self, prompt: Prompt) -> list[int]:
        self.at = (int(prompt.metadata["step"]), int(prompt.metadata["index"]))
        return super().reset(prompt)

    def step(self, generated: list[int], finish_reason: str) -> EnvStep:
        if self.at == self.crash:
            raise RankDown(f"environment crashed on step {self.at[0]} session {self.at[1]}")
        return super().step(generated, finish_reason)
