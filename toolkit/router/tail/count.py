"""``count``: nothing before the flip. Every group serves the step until ``ceil(threshold * n)`` of its
sessions are done; then the rest goes to the tail group (``flip.py``). The seed's behaviour, and the
right one when lengths cannot be told apart early (a cap close to the typical turn). It ignores length
hints."""

from __future__ import annotations

from toolkit.config import TailPolicyName
from toolkit.router.tail.base import StepRecord, TailPolicy


class CountPolicy(TailPolicy):
    name = TailPolicyName.count
    reads_hints = False

    def start_on_tail(self, rec: StepRecord, session: str, prompt_key: str, hint: int = 0) -> bool:
        return False
