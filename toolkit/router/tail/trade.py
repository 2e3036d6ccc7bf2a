"""Trades of places on the tail group (``tail.trade_margin``, with ``tail.policy=age``).

Once the tail group is full, a long runner elsewhere can only get there if something leaves. A trade
sends the tail group's request of least expected work left back to the bulk and the long runner of
most in its place, while the runner's exceeds the resident's by ``trade_margin`` tokens (a trade pays
two moves). What the router expects of a request comes from the job's last step, all of whose turns
ended (this step's so far are its short ones): a turn that has run ``a`` tokens still makes
``E[L - a | L > a]`` over the last step's turn lengths, and a session that has finished ``k`` turns
still runs ``E[T - k - 1 | T > k]`` more over the last step's sessions, each worth its mean turn.

The turns still to come are what makes a trade pay: the step ends with the session that has most
ahead of it, not the turn. Trades by the turn alone gained nothing over ``age`` in the old fleet
model, and with moves that recompute their context the two recomputes of a trade cost what it wins;
with ``tail.move=kv`` they take the tail bench to 1.44x and 1.29 of its bound in the fleet twin
(``python -m toolkit.bench tail_model``).
"""

from __future__ import annotations

import bisect
import statistics
from itertools import accumulate

from toolkit.router.tail.base import StepRecord


class WorkLeft:
    """Expected output tokens still to come of a running request, by the job's last step."""

    __slots__ = ("lengths", "suffix", "turns", "turns_suffix", "mean")

    def __init__(self, last: StepRecord) -> None:
        self.lengths = last.lengths.sorted()
        self.suffix = [*accumulate(reversed(self.lengths))][::-1] + [0]
        """Sum of ``lengths[i:]``."""
        self.turns = sorted(len(v) for v in last.by_session.values())
        self.turns_suffix = [*accumulate(reversed(self.turns))][::-1] + [0]
        self.mean = statistics.fmean(self.lengths)

    @classmethod
    def of(cls, last: StepRecord | None) -> WorkLeft | None:
        """From a finished step; None if it finished no turn of a session (nothing to go on)."""
        return cls(last) if last is not None and last.lengths and last.by_session else None

    def __call__(self, tokens: float, turns_done: int) -> float:
        """A request whose turn has generated ``tokens``, in a session that has finished ``turns_done``."""
        i = bisect.bisect_right(self.lengths, tokens)
        longer = len(self.lengths) - i
        this_turn = self.suffix[i] / longer - tokens if longer else 0.0
        j = bisect.bisect_right(self.turns, turns_done)
        sessions = len(self.turns) - j  # sessions of the last step that ran more turns than this one has
        after = self.turns_suffix[j] / sessions - turns_done - 1 if sessions else 0.0
        return this_turn + after * self.mean
