"""``age``: a request running outside the tail group that has generated more than a long turn of this
step (``tail.long_quantile`` of the finished turns, or ``tail.long_tokens``) moves to the tail group at
once, with its tokens, the oldest first while the group has room.

Why age: turn lengths are heavy-tailed (lognormal-like), and for such a law the longer a request has
run, the longer it is still expected to run; the step ends with those requests, so they are the ones
to run where a request decodes fastest. No prediction, no model: only what the step has shown.
"""

from __future__ import annotations

from toolkit.router.tail.base import StepRecord, TailPolicy


class AgePolicy(TailPolicy):
    name = "age"

    def move_above(self, rec: StepRecord) -> float | None:
        return self.long_turn(rec)
