"""Environments: the token-level protocol a session runs against, and the built-in tasks.

An environment is a Hydra ``_target_`` class: ``reset`` gives the first prompt's tokens, ``step``
takes one turn's generated tokens and returns observation tokens, a reward and whether the episode
is done. Users add their own by pointing ``workload.env._target_`` at any class with this shape.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from toolkit.rollout.prompts import Prompt, SpecProblem, int_problems


@dataclass
class EnvStep:
    observation: list[int] = field(default_factory=list)
    """Tokens appended after the generation (tool output, user turn); loss-masked out."""
    reward: float = 0.0
    """Reward of this turn; a session's reward is the sum over its turns."""
    done: bool = False


class Environment(ABC):
    @abstractmethod
    def reset(self, prompt: Prompt) -> list[int]:
        """Start an episode; return the first prompt's token ids."""

    @abstractmethod
    def step(self, generated: list[int], finish_reason: str) -> EnvStep:
        """Take one turn's generated tokens; return the observation, reward and done."""


RewardFn = Callable[[Prompt, list[int], str], float]


def stopped_within(prompt: Prompt | None, generated: list[int], finish_reason: str, max_len: int = 1 << 30) -> float:
    """The default reward: 1 when the model stopped on its own within ``max_len`` tokens, else 0."""
    return 1.0 if finish_reason == "stop" and len(generated) <= max_len else 0.0


class SingleTurnEnv(Environment):
    """One generation per episode, scored by a reward function.

    ``reward_fn`` is a dotted path to ``fn(prompt, generated, finish_reason) -> float`` (the prompt
    carries its metadata, e.g. a reference answer from a prompt file); default :func:`stopped_within`
    with ``max_len``.
    """

    def __init__(self, max_len: int = 1 << 30, reward_fn: str | None = None) -> None:
        self.max_len = max_len
        self.reward_fn: RewardFn | None = None
        if reward_fn is not None:
            module, _, name = reward_fn.rpartition(".")
            self.reward_fn = getattr(importlib.import_module(module), name)
        self.prompt: Prompt | None = None

    def reset(self, prompt: Prompt) -> list[int]:
        self.prompt = prompt
        return list(prompt.token_ids)

    def step(self, generated: list[int], finish_reason: str) -> EnvStep:
        if self.reward_fn is None:
            reward = stopped_within(self.prompt, generated, finish_reason, self.max_len)
        else:
            assert self.prompt is not None, "step() before reset()"
            reward = float(self.reward_fn(self.prompt, generated, finish_reason))
        return EnvStep(reward=reward, done=True)


class ToolCallEnv(Environment):
    """A multi-turn tool-style task: every turn is a "tool call" answered by an observation.

    The tool's answer is a deterministic function of the call (a framed digest of the generated
    tokens), so replays are exact. The episode ends after ``max_turns`` turns. Reward: 1 per turn
    that ended on its own (``stop``), over the number of turns: well-formed, terminated calls.
    """

    OBS_OPEN = 3
    OBS_CLOSE = 4

    def __init__(self, max_turns: int = 3, observation_tokens: int = 24, vocab_size: int = 32000) -> None:
        if max_turns < 1 or observation_tokens < 2:
            raise ValueError(f"need max_turns >= 1 and observation_tokens >= 2, got {max_turns}, {observation_tokens}")
        self.max_turns = max_turns
        self.observation_tokens = observation_tokens
        self.vocab_size = vocab_size
        self.turn = 0

    @classmethod
    def check_spec(cls, spec: dict[str, Any]) -> list[SpecProblem]:
        """Problems with its Hydra arguments, before anything starts (``validate``)."""
        return int_problems(cls, spec, {"max_turns": 1, "observation_tokens": 2, "vocab_size": 2})

    def reset(self, prompt: Prompt) -> list[int]:
        self.turn = 0
        return list(prompt.token_ids)

    def step(self, generated: list[int], finish_reason: str) -> EnvStep:
        self.turn += 1
        reward = (1.0 if finish_reason == "stop" else 0.0) / self.max_turns
        if self.turn >= self.max_turns:
            return EnvStep(reward=reward, done=True)
        k = self.observation_tokens - 2
        acc = 1469598103
        body = []
        for i in range(k):
            acc = (acc * 1099511 + (generated[i % len(generated)] if generated else i)) % (1 << 31)
            body.append(5 + acc % (self.vocab_size - 5))
        return EnvStep(observation=[self.OBS_OPEN, *body, self.OBS_CLOSE], reward=reward, done=False)
