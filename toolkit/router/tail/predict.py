"""``predict``: a session whose earlier turns in this step were long, or whose prompt siblings'
(``samples_per_prompt``: sessions that share ``Generate.prompt_key``) turns were long on average,
starts its next turn on the tail group while it has room. It moves nothing that runs.

It wins where lengths are correlated within a session or a prompt (Seer, arXiv:2511.14617, §2.3:
"responses within the same group have highly correlated generation lengths"); with independent
turns it only picks sessions that are behind. A turn that carries a length hint starts there when the
hint says it is long (``TailPolicy.start_on_tail``).
"""

from __future__ import annotations

import statistics

from toolkit.config import TailPolicyName
from toolkit.router.tail.base import StepRecord, TailPolicy


class PredictPolicy(TailPolicy):
    name = TailPolicyName.predict

    def start_on_tail(self, rec: StepRecord, session: str, prompt_key: str, hint: int = 0) -> bool:
        if super().start_on_tail(rec, session, prompt_key, hint):
            return True
        limit = self.long_turn(rec)
        if limit is None:
            return False
        if any(n > limit for n in rec.by_session.get(session, ())):
            return True
        siblings = rec.by_prompt.get(prompt_key) if prompt_key else None
        return siblings is not None and bool(siblings) and statistics.fmean(siblings) > limit
