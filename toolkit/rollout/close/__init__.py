"""How a rank's step ends (``rollout.close``): ``all`` waits for every session it started, ``count``
closes on a count of finished groups and carries the rest on (docs/partial.md)."""

from toolkit.config import CloseMode
from toolkit.rollout.close.all import CloseAll
from toolkit.rollout.close.base import STEP_COUNTERS, Landed, RunSession, StepClose
from toolkit.rollout.close.count import CloseOnCount

CLOSERS: dict[CloseMode, type[StepClose]] = {CloseMode.all: CloseAll, CloseMode.count: CloseOnCount}

__all__ = ["CLOSERS", "STEP_COUNTERS", "CloseAll", "CloseOnCount", "Landed", "RunSession", "StepClose"]
