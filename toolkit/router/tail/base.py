"""What a tail policy decides, and what it decides from.

A policy sees only what the step has revealed so far (:class:`StepRecord`: the lengths of the turns
the step finished, per session and per prompt) and a running request's tokens (the router's estimate,
``toolkit/router/speed.py``). It answers two questions: should a new turn start on the tail group,
and should a running request move there now. The router (``routing.py``) acts on the answers, only
while the tail group has room.
"""

from __future__ import annotations

import bisect
from abc import ABC
from typing import ClassVar

from toolkit.config import TailConfig


class StepRecord:
    """What one job's current step has revealed to the router."""

    __slots__ = ("step", "lengths", "by_session", "by_prompt", "on_tail")

    def __init__(self, step: int) -> None:
        self.step = step
        self.lengths: list[int] = []
        """Output tokens of every turn the step finished, sorted."""
        self.by_session: dict[str, list[int]] = {}
        """Finished turn lengths per session, in order."""
        self.by_prompt: dict[str, list[int]] = {}
        """Finished turn lengths per prompt key (sessions that share a prompt: GRPO siblings)."""
        self.on_tail: set[str] = set()
        """Sessions that ran a turn on the tail group before the flip (their later turns prefer it)."""

    def finished(self, session: str, prompt_key: str, tokens: int) -> None:
        bisect.insort(self.lengths, tokens)
        if session:
            self.by_session.setdefault(session, []).append(tokens)
        if prompt_key:
            self.by_prompt.setdefault(prompt_key, []).append(tokens)

    def quantile(self, q: float) -> int:
        """The ``q``-quantile of the finished turn lengths (the nearest rank; needs one at least)."""
        return self.lengths[min(len(self.lengths) - 1, int(q * len(self.lengths)))]


class TailPolicy(ABC):
    name: ClassVar[str]
    reserves_group: ClassVar[bool] = True
    """Before the flip, the tail group serves only what this policy sends there (else: every group
    serves the step)."""

    def __init__(self, tc: TailConfig) -> None:
        self.tc = tc

    def long_turn(self, rec: StepRecord) -> float | None:
        """Tokens above which a turn counts as long in this step; None while the step has not revealed
        enough (fewer than ``long_min_finished`` finished turns)."""
        if self.tc.long_tokens is not None:
            return self.tc.long_tokens
        if len(rec.lengths) < self.tc.long_min_finished:
            return None
        return rec.quantile(self.tc.long_quantile)

    def start_on_tail(self, rec: StepRecord, session: str, prompt_key: str) -> bool:
        """A new turn of ``session`` should start on the tail group (if it has room). A session that
        already ran there stays, for its prefix cache."""
        return session in rec.on_tail

    def move_above(self, rec: StepRecord) -> float | None:
        """Tokens above which a request of this step running outside the tail group should move there
        now; None: none should."""
        return None

    def move(self, rec: StepRecord, tokens: float) -> bool:
        limit = self.move_above(rec)
        return limit is not None and tokens > limit
