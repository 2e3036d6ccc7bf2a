"""Tail routing: getting a step's long runners onto the fast tail group (``tail.*``).

Two mechanisms, both the router's alone: the count flip (``flip.py``: at ``ceil(threshold * n)``
sessions done the rest of the step goes to the tail group, and a sentinel file tells the ranks), and a
policy that picks long runners before any flip (``tail.policy``: ``count.py``, ``age.py``,
``predict.py``, one class each over the ABC in ``base.py``). ``routing.py`` holds them together for the
router: where a request goes, which running requests move, and what each step has revealed.
Whether a policy keeps the group for its long runners, and the flip's count, are the tail config's
(``TailConfig.reserves_group``, ``flip_count``): the ranks' step report reads them too.
"""

from toolkit.config import TailPolicyName, flip_count
from toolkit.router.tail.age import AgePolicy
from toolkit.router.tail.base import TailPolicy
from toolkit.router.tail.count import CountPolicy
from toolkit.router.tail.flip import CountFlip
from toolkit.router.tail.predict import PredictPolicy

TAIL_POLICIES: dict[TailPolicyName, type[TailPolicy]] = {p.name: p for p in (CountPolicy, AgePolicy, PredictPolicy)}
"""``tail.policy``'s implementations, one per :class:`~toolkit.config.TailPolicyName` (a new policy: its
module, its name in the enum and its line here)."""

__all__ = ["TAIL_POLICIES", "CountFlip", "TailPolicy", "flip_count"]
