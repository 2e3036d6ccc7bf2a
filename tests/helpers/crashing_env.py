"""Environments that fail on a chosen session: one raises (its sample fails), one takes its rank down
(the whole run fails, and tears down)."""

from __future__ import annotations

import os
import time

from toolkit.core.errors import RouterUnavailable
from toolkit.rollout.envs import EnvStep, SingleTurnEnv
from toolkit.rollout.prompts import Prompt


class CrashOnSession(SingleTurnEnv):
    def __init__(self, crash_index: int = 3) -> None:
        super().__init__()
        self.crash_index = crash_index
        self.index = -1

    def reset(self, prompt: Prompt) -> list[int]:
        self.index = int(prompt.metadata["index"])
        return super().reset(prompt)

    def step(self, generated: list[int], finish_reason: str) -> EnvStep:
        if self.index == self.crash_index:
            raise RuntimeError(f"environment crashed on session {self.index}")
        return super().step(generated, finish_reason)


class ExitOnSession(CrashOnSession):
    """Exits its rank's process outright (as a segfaulting extension would): not a sample's failure."""

    def step(self, generated: list[int], finish_reason: str) -> EnvStep:
        if self.index == self.crash_index:
            os._exit(13)
        return super().step(generated, finish_reason)


class Abandon(BaseException):
    """A library's own BaseException (gevent's Timeout, a test framework's Failed)."""


class MisbehaveOnSessions(CrashOnSession):
    """Sessions 1-8 each misbehave their own way; each must fail its own sample, and nothing else."""

    def step(self, generated: list[int], finish_reason: str) -> EnvStep:
        if self.index == 1:
            time.sleep(3600)  # a synchronous hang: bounded by workload.env_timeout_s
        if self.index == 2:
            return EnvStep(observation=[1, 2**40])  # not an int32 id: the step's packing would overflow
        if self.index == 3:
            return EnvStep(observation=[1.5])  # a float: the router could not read the next request
        if self.index == 4:
            raise RouterUnavailable("a toolkit error the user's code let through")
        if self.index == 5:
            return EnvStep(reward=float("nan"), done=True)
        if self.index == 6:
            raise Abandon("past every except Exception")
        if self.index == 7:
            next(iter(()))  # StopIteration, which a future refuses
        if self.index == 8:
            return EnvStep(observation=b"text")  # bytes iterate as ints: not ids
        return super().step(generated, finish_reason)
