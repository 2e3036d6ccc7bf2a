"""The interface of a step's ending: a rank's :class:`StepClose` starts its sessions, decides which
finished ones land in the open step, and hands the step over when it closes."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from toolkit.config import Config
from toolkit.session.columns import ColumnBuilder, Packer
from toolkit.session.requests import OpenStep, RequestLog
from toolkit.session.sample import Sample

SessionLanded = Callable[[int, str], Awaitable[None]]
"""Tells the router that session ``session_id`` landed in step ``step`` (its ``SessionDone``: the tail
flip counts the sessions that close a step)."""

RunSession = Callable[[int, int, int], Awaitable[list[Sample]]]
"""Runs one session to its end: ``(started_step, index, attempt) -> its samples`` (attempt > 0: a
restart, whose requests need ids of their own)."""

STEP_COUNTERS = ("carried_in", "carried_out", "dropped_stale", "restarted_stale", "filtered_groups",
                 "group_starts", "closed_short", "tokens_discarded", "tokens_in_flight")
"""What each rank counts of its step, summed over ranks into the step report."""


@dataclass
class Landed:
    """What landed in a step on this rank."""

    builder: Packer
    """The samples, packed as they landed."""
    log: RequestLog
    """The step's requests: every request answered while the step was open."""
    counts: Counter[str] = field(default_factory=Counter)
    """:data:`STEP_COUNTERS` of this rank."""
    in_flight: list[tuple[int, int, int]] = field(default_factory=list)
    """Groups still running when the step closed, as ``(started_step, group, attempt)``: a resumed run
    restarts them."""


def share(total: int, rank: int, size: int) -> int:
    """Rank ``rank``'s part of ``total`` split as evenly as can be over ``size`` ranks."""
    return total // size + (1 if rank < total % size else 0)


class StepClose(ABC):
    def __init__(self, cfg: Config, rank: int, size: int, group_size: int, run: RunSession,
                 group_names: list[str], new_log: Callable[[], RequestLog], first_step: int,
                 landed: SessionLanded, packer: Callable[[list[str]], Packer] = ColumnBuilder) -> None:
        """``packer``: what the landed samples are packed with (every column, unless the caller writes no
        rows: the twin's stats alone)."""
        self.cfg = cfg
        self.landed = landed
        self.rank, self.size = rank, size
        self.group_size = group_size
        """Sessions per prompt (a GRPO group)."""
        self.run = run
        self.group_names = group_names
        self.new_log = new_log
        self.open = OpenStep(first_step, new_log())
        """The step sessions land in now; sessions read it at each request."""
        self.packer = packer
        self.builder = packer(group_names)
        self.counts: Counter[str] = Counter()

    @abstractmethod
    def sessions_to_close(self) -> int:
        """This rank's sessions a step needs before it closes."""

    @abstractmethod
    async def collect(self, step: int, version: int = 0) -> Landed:
        """Run ``step`` until it closes; what landed in it. The next step is open when it returns.
        ``version``: the weights the step runs with (rank 0's, sent with the step's start)."""

    def resume(self, groups: list[tuple[int, int, int]]) -> None:  # noqa: B027 - only count carries
        """Groups a resumed run restarts (``close=count``: what the step before it carried on)."""

    async def aclose(self) -> None:  # noqa: B027 - only count has sessions between steps
        """The run ends: cancel what is still running (its requests leave the engines)."""

    def _hand_over(self, step: int) -> Landed:
        landed = Landed(self.builder, self.open.log, self.counts)
        self.builder, self.counts = self.packer(self.group_names), Counter()
        self.open.step, self.open.log = step + 1, self.new_log()
        return landed


async def cancel_all(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
