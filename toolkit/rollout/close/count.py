"""``rollout.close=count``: a rank's step closes once its share of ``sessions_per_step`` has landed in
whole groups; the groups still running are carried on and land in the step in which they end.

Each rank keeps its share of ``sessions_per_step * (1 + over_sample)`` sessions in flight: a group that
lands is replaced at once (measured against refilling only as each step begins: docs/partial.md), and
so is one that finished without counting: dropped or restarted for ``max_staleness`` (stopped as soon as
it can no longer land within it), or filtered (``filter_groups``). A step starts at most
``max_group_starts_per_step`` groups; one that reaches it with nothing left running closes short.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from toolkit.config import Config, GroupFilter, StaleAction
from toolkit.rollout.close.base import Landed, RunSession, SessionLanded, StepClose, cancel_all, share
from toolkit.session.columns import ColumnBuilder, Packer
from toolkit.session.requests import RequestLog
from toolkit.session.sample import Sample, session_id

Group = tuple[int, int, int]
"""``(started_step, group, attempt)``: group ``group`` of step ``started_step``, sessions
``group * group_size ...``; attempt > 0 after a restart."""


class CloseOnCount(StepClose):
    def __init__(self, cfg: Config, rank: int, size: int, group_size: int, run: RunSession,
                 group_names: list[str], new_log: Callable[[], RequestLog], first_step: int,
                 landed: SessionLanded, packer: Callable[[list[str]], Packer] = ColumnBuilder) -> None:
        super().__init__(cfg, rank, size, group_size, run, group_names, new_log, first_step, landed, packer)
        self.counted_ids: list[tuple[int, str]] = []
        """Sessions that landed and counted, not yet told to the router (``landed``)."""
        r = cfg.rollout
        groups = cfg.sessions_per_step // group_size
        flight = math.ceil(groups * (1 + r.over_sample) - 1e-9)
        self.quota = share(groups, rank, size)
        """Groups that close this rank's part of a step."""
        self.target = share(flight, rank, size)
        """Groups this rank keeps in flight."""
        self.max_starts = share(r.max_group_starts_per_step or 4 * flight, rank, size)
        self.running: dict[Group, asyncio.Task[None]] = {}
        self.started_at: dict[Group, int] = {}
        """The step each running group's attempt began in: its policy without ``weights_dir``."""
        self.newest = 0
        """The newest weight version a landed sample holds: the engines' weights, as this rank knows them."""
        self.counted = 0
        """Groups that landed in the open step and count toward closing it."""
        self.next_group = 0
        """The open step's next group number (of this rank's: ``rank + size * j``)."""
        self.full: list[tuple[Group, list[Sample], list[Sample]]] = []
        """Groups that ended while the open step was full (it closes at once), or between two steps (rank 0
        waits for the weights the next one runs with, which their staleness is judged against): they land
        in the next step once it begins."""
        self.collecting = False
        self.changed = asyncio.Event()
        self.error: BaseException | None = None

    def sessions_to_close(self) -> int:
        return self.quota * self.group_size

    def resume(self, groups: list[Group]) -> None:
        for started, g, attempt in groups:
            # From their first turn, with ids of their own (the requests of the run before may be cached).
            self._start((started, g, attempt + 1))

    async def collect(self, step: int, version: int = 0) -> Landed:
        self.open.step = step
        self.newest = max(self.newest, version)
        self.collecting = True
        full, self.full = self.full, []
        for args in full:
            self._land(*args)
        await self._tell()
        await self._drop_doomed(step)
        self._top_up(self.target)
        while self.counted < self.quota and self.error is None:
            if not self.running:
                self.counts["closed_short"] = 1
                break
            self.changed.clear()
            await self.changed.wait()
        if self.error is not None:
            raise self.error
        # Carried on: what still runs, and what ended while the step was full (it lands in the next).
        in_flight = sorted([*self.running, *(g for g, _, _ in self.full)])
        self.counts["carried_out"] = len(in_flight) * self.group_size
        self.counts["tokens_in_flight"] = sum(self.open.generated.values())
        landed = self._hand_over(step)
        landed.in_flight = in_flight
        self.counted, self.next_group = 0, 0
        self.collecting = False
        return landed

    async def _tell(self) -> None:
        ids, self.counted_ids = self.counted_ids, []
        for step, sid in ids:
            await self.landed(step, sid)

    async def aclose(self) -> None:
        await cancel_all(list(self.running.values()))
        self.running.clear()

    async def _drop_doomed(self, step: int) -> None:
        """Groups that can no longer land within ``max_staleness`` stop now, not when they end: their
        oldest weights are already too far behind (or, without ``weights_dir``, they began too many steps
        ago), and that only grows. Dropped (rows ``stale``, without the tokens so far) or restarted."""
        r = self.cfg.rollout
        if r.max_staleness is None:
            return
        behind = {g: self._running_behind(g, step) for g in self.running}
        doomed = [g for g, b in behind.items() if b > r.max_staleness]
        if not doomed:
            return
        await cancel_all([self.running.pop(g) for g in doomed])
        for group in doomed:
            started, g, attempt = group
            self.started_at.pop(group)
            sids = [(i, session_id(self.cfg.job, started, i)) for i in self._members(g)]
            self.counts["tokens_discarded"] += sum(self.open.forget(sid) for _, sid in sids)
            if r.stale == StaleAction.restart:
                self.counts["restarted_stale"] += self.group_size
                self._start((started, g, attempt + 1))
                continue
            self.counts["dropped_stale"] += self.group_size
            rows = [Sample.start(i, sid, []) for i, sid in sids]
            for s in rows:
                s.started_step, s.carried, s.staleness = started, step - started, behind[group]
            self._add(rows, "stale", f"dropped while running: {behind[group]} versions behind at step {step} "
                                     f"(rollout.max_staleness = {r.max_staleness}); its tokens so far discarded")
            self._top_up(len(self.running) + 1)

    def _running_behind(self, group: Group, step: int) -> int:
        """How far behind a running group already is (it only grows until it lands)."""
        if not self.cfg.rollout.handshake:
            return step - self.started_at[group]
        started, g, _ = group
        known = [self.open.oldest[sid] for i in self._members(g)
                 if (sid := session_id(self.cfg.job, started, i)) in self.open.oldest]
        return self.newest - min(known) if known else 0

    def _members(self, g: int) -> range:
        return range(g * self.group_size, (g + 1) * self.group_size)

    # ---- starting and landing -------------------------------------------------------------------
    def _top_up(self, want: int) -> None:
        """Start groups of the open step until ``want`` run, within the step's starts."""
        while len(self.running) < want and self.counts["group_starts"] < self.max_starts:
            g = self.rank + self.size * self.next_group
            self.next_group += 1
            self._start((self.open.step, g, 0))

    def _start(self, group: Group) -> None:
        self.counts["group_starts"] += 1
        self.started_at[group] = self.open.step
        self.running[group] = asyncio.create_task(self._group(group), name=f"group {group}")

    async def _group(self, group: Group) -> None:
        started, g, attempt = group
        members = self._members(g)
        try:
            results = await asyncio.gather(*(self.run(started, i, attempt) for i in members))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the toolkit's own failure: the step raises it
            self.error = exc
            self.changed.set()
            return
        del self.running[group]
        try:
            self._land(group, [s for samples in results for s in samples], [r[-1] for r in results if r])
        except Exception as exc:  # noqa: BLE001 - the step raises it (a task's error would only be logged)
            self.error = exc
            self.changed.set()
            return
        self.changed.set()
        await self._tell()

    def _land(self, group: Group, samples: list[Sample], finals: list[Sample]) -> None:
        if self.counted >= self.quota or not self.collecting:
            self.full.append((group, samples, finals))
            return
        r = self.cfg.rollout
        started, g, attempt = group
        step = self.open.step
        began = self.started_at.pop(group)
        for s in finals:
            self.open.forget(s.session_id)
        self.newest = max([self.newest, *(v for s in samples for v in s.weight_versions)])
        behind = self._behind(samples, step, began) if samples else 0
        for s in samples:
            s.started_step, s.carried, s.staleness = started, step - started, behind
        if any(s.carried for s in finals):
            self.counts["carried_in"] += len(finals)
        if r.max_staleness is not None and behind > r.max_staleness:
            self.counts["tokens_discarded"] += sum(s.generated_tokens for s in samples)
            if r.stale == StaleAction.restart:
                self.counts["restarted_stale"] += len(finals)
                self._start((started, g, attempt + 1))
                return
            self.counts["dropped_stale"] += len(finals)
            self._add(samples, "stale", f"dropped: {behind} versions behind step {step} "
                                        f"(rollout.max_staleness = {r.max_staleness})")
        elif r.filter_groups == GroupFilter.zero_variance and len({s.reward for s in finals}) == 1:
            self.counts["filtered_groups"] += 1
            self._add(samples, "filtered", f"every reward of its group is {finals[0].reward}")
        else:
            self._add(samples)
            self.counted += 1
            self.counted_ids += [(step, s.session_id) for s in finals]
            self._top_up(self.target)  # in flight again what the step keeps in flight
            return
        self._top_up(len(self.running) + 1)  # it did not count: another group in its place

    def _add(self, samples: list[Sample], status: str = "", why: str = "") -> None:
        for s in samples:
            if status and s.status not in ("failed", "aborted"):
                s.mark(status, why)
            self.builder.add(s)

    def _behind(self, samples: list[Sample], step: int, began: int) -> int:
        """Versions between the group's oldest token's weights and the newest the engines hold (a member
        without tokens, failed at its start, has no say); without a weights handshake (each step nominally
        its own policy), or with no member's tokens: steps since its attempt began."""
        oldest = [min(s.weight_versions) for s in samples if s.weight_versions] if self.cfg.rollout.handshake else []
        return self.newest - min(oldest) if oldest else step - began
