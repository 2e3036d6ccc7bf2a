"""An environment that takes its rank down in one chosen session of one chosen step: for "ranks fail
loudly together". Whatever an environment raises only fails its sample, but the process going
(``Terminated``: what SIGTERM raises in it) is the rank's own end."""

from __future__ import annotations

from toolkit.core.errors import Terminated
from toolkit.rollout.envs import EnvStep, SingleTurnEnv
from toolkit.rollout.prompts import Prompt


class RankDown(Terminated):
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
