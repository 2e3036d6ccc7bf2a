"""What a tail policy decides, and what it decides from.

A policy sees only what the step has revealed so far (:class:`StepRecord`: the lengths of the turns
the step finished, per session and per prompt, and how long the job's last step found a long turn), a
turn's length hint if its client sent one (``Generate.expected_tokens``) and a running request's
tokens (the router's estimate, ``toolkit/router/speed.py``). It answers two questions: should a new
turn start on the tail group, and should a running request move there now (:class:`MoveLimits`). The
router (``routing.py``) acts on the answers, only while the tail group has room.
"""

from __future__ import annotations

import math
from abc import ABC
from dataclasses import dataclass
from typing import ClassVar

from toolkit.config import TailConfig, TailPolicyName
from toolkit.router.tail.lengths import Lengths


class StepRecord:
    """What one job's current step has revealed to the router."""

    __slots__ = ("step", "lengths", "by_session", "by_prompt", "on_tail", "last_long", "hinted")

    def __init__(self, step: int, last_long: float | None = None) -> None:
        self.step = step
        self.last_long = last_long
        """The long-turn limit of the job's last step, over all its turns (``TailPolicy.long_hint``)."""
        self.lengths = Lengths()
        """Output tokens of every turn the step finished."""
        self.by_session: dict[str, list[int]] = {}
        """Finished turn lengths per session, in order."""
        self.by_prompt: dict[str, list[int]] = {}
        """Finished turn lengths per prompt key (sessions that share a prompt: GRPO siblings)."""
        self.on_tail: set[str] = set()
        """Sessions that ran a turn on the tail group before the flip (their later turns prefer it)."""
        self.hinted = False
        """A request of the step carried a length hint (until one does, no hint can move anything)."""

    def finished(self, session: str, prompt_key: str, tokens: int) -> None:
        self.lengths.add(tokens)
        if session:
            self.by_session.setdefault(session, []).append(tokens)
        if prompt_key:
            self.by_prompt.setdefault(prompt_key, []).append(tokens)

    def quantile(self, q: float) -> int:
        """The ``q``-quantile of the finished turn lengths (the nearest rank; needs one at least)."""
        return self.lengths.kth(min(len(self.lengths) - 1, int(q * len(self.lengths))))


class TailPolicy(ABC):
    name: ClassVar[TailPolicyName]
    reads_hints: ClassVar[bool] = True
    """The policy places turns by their length hints (``Generate.expected_tokens``)."""

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

    def long_hint(self, rec: StepRecord) -> float | None:
        """Tokens above which a turn's length hint calls it long: ``long_tokens``, else the long-turn
        limit of the job's last step (all its turns finished: the early finishers of this one are the
        short turns, and a hint is read when its turn starts), else this step's so far."""
        if self.tc.long_tokens is not None:
            return self.tc.long_tokens
        return rec.last_long if rec.last_long is not None else self.long_turn(rec)

    def start_on_tail(self, rec: StepRecord, session: str, prompt_key: str, hint: int = 0) -> bool:
        """A new turn of ``session`` should start on the tail group (if it has room): a session that
        already ran there stays, for its prefix cache; a turn whose client expects it to be long
        (``hint`` tokens, 0: no hint) starts there; and while no turn of an unhinted step has finished,
        any turn does. At a step's start nothing tells a long turn yet, so a room kept free for long
        runners would idle until the first of them showed; the turns that fill it are as likely as
        any to be long, start faster there, and leave it as they end, without a move's recompute
        (the old fleet model of ``tail_model``: +0.02x and -0.02 ``bound_ratio`` for ``age``, a quarter
        fewer moves)."""
        if session in rec.on_tail:
            return True
        if hint <= 0:
            return not rec.lengths and not rec.hinted
        limit = self.long_hint(rec)
        # At least as long: where the cap makes a tenth of the turns the same length, those are the long ones.
        return limit is not None and hint >= limit

    def move_limits(self, rec: StepRecord) -> MoveLimits | None:
        """When a request of this step running outside the tail group should move there now (asked once
        a tick for every request); None: none should."""
        return None


@dataclass(frozen=True)
class MoveLimits:
    """When a running request moves to the tail group, and which goes first into little room."""

    age: float | None
    """Tokens above which a request moves (None: none moves for its age)."""
    hint: float | None
    """A hinted request moves while its hint says at least this many tokens are still to come (None:
    none moves for its hint)."""

    def priority(self, tokens: float, hint: int = 0) -> float | None:
        """How much a request that has generated ``tokens`` (its length hint ``hint``, 0: none) is still
        expected to generate, if it should move (the most first); None: it should not. A turn whose hint
        says a long turn is still to come moves even while young; one whose hint says it ends within
        the age limit stays however old. Otherwise (past its hint, with none, or in between) its age
        rules, as for a turn that has run this long the heavy tail expects about as much again."""
        left = hint - tokens
        if hint > 0 and left > 0:
            if self.hint is not None and left >= self.hint:
                return left
            about_to_end = self.age if self.age is not None else self.hint
            if about_to_end is None or left < about_to_end:
                return None
        return tokens if self.age is not None and tokens > self.age else None


EVERYTHING = MoveLimits(-math.inf, -math.inf)
"""After a flip with ``tail.migrate_inflight``: every request of the step moves."""
