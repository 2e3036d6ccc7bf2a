"""``age``: a request running outside the tail group that has generated more than a long turn of this
step (``tail.long_quantile`` of the finished turns, or ``tail.long_tokens``) moves to the tail group at
once, with its tokens, the oldest first while the group has room.

Why age: turn lengths are heavy-tailed (lognormal-like), and for such a law the longer a request has
run, the longer it is still expected to run; the step ends with those requests, so they are the ones
to run where a request decodes fastest. No prediction, no model: only what the step has shown.
Until the first turn of a step ends, new turns fill the tail group's room (``TailPolicy.start_on_tail``).

With length hints (``Generate.expected_tokens``: ``workload.length_hint``, or an agent's) a turn hinted
at least as long as a long turn of the job's last step starts on the tail group, and while a running
turn's hint says at least that much is still to come it moves there however young, the most left
first; a turn its hint says ends within the age limit stays. Otherwise its age rules
(:class:`~toolkit.router.tail.base.MoveLimits`).
"""

from __future__ import annotations

from toolkit.config import TailPolicyName
from toolkit.router.tail.base import MoveLimits, StepRecord, TailPolicy


class AgePolicy(TailPolicy):
    name = TailPolicyName.age

    def move_limits(self, rec: StepRecord) -> MoveLimits | None:
        age, hint = self.long_turn(rec), self.long_hint(rec) if rec.hinted else None
        return None if age is None and hint is None else MoveLimits(age, hint)
