"""The router's tail routing: where a request of a step goes, and which running requests move.

It alone decides: ranks send requests without a group (unless their user names one), and it places
each of them (a group, or :data:`BULK`: every group but the tail group). It owns the count flip
(``flip.py``), the policy (``tail.policy``) and what each job's current step has revealed
(:class:`StepRecord`); every tick (:meth:`TailRouting.tick_s`) the server asks it for the running
requests to move to the tail group. Moves happen only into room: the tail group's spare slots less the
moves on their way, so a moved request never waits in the queue while it could have gone on running.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable, Iterator
from itertools import chain, islice

from toolkit.config import TailConfig
from toolkit.core.errors import ConfigError, FieldError
from toolkit.core.protocol import Generate, StepProgress
from toolkit.core.rundir import FileWriter, RunDir
from toolkit.router.migration import can_continue
from toolkit.router.pool import BULK, PoolKey, ReplicaPool
from toolkit.router.queue import Request, hinted, plain
from toolkit.router.replica import Replica
from toolkit.router.tail import TAIL_POLICIES
from toolkit.router.tail.base import EVERYTHING, MoveLimits, StepRecord, TailPolicy
from toolkit.router.tail.flip import CountFlip
from toolkit.router.tail.trade import WorkLeft
from toolkit.router.timeline import Timeline

logger = logging.getLogger(__name__)

TICK_S = 0.05
"""How often the router looks for running requests to move, in a fleet of up to :data:`TICK_REPLICAS`
replicas: a request on a busy replica makes ~100-300 tokens a second, so a move comes within a few
percent of a long turn of its threshold."""
TICK_REPLICAS = 512
"""Past this many replicas the ticks come less often, in proportion (:meth:`TailRouting.tick_s`): a tick
prices the oldest request of every replica, 20-25 ms at 4,096 replicas, which every 50 ms would take a
third of the router's time and hold back its dispatch."""


def _may_move(req: Request, step: int) -> bool:
    """``req`` is of ``step`` (its job's current one), did not name its group, and may move now."""
    return req.msg.step == step and req.msg.group is None and _can_move(req)


def _can_move(req: Request) -> bool:
    """``req`` may be aborted and go on elsewhere now: not already moving, not resent after a replica
    died, not given up by its client, and able to continue from its tokens (``can_continue``)."""
    return not (req.migrating or req.deaths or req.client_aborted) and can_continue(req.msg)


def make_tail_policy(tc: TailConfig) -> TailPolicy:
    cls = TAIL_POLICIES.get(tc.policy)
    if cls is None:
        raise ConfigError([FieldError("tail.policy", tc.policy, f"one of {list(TAIL_POLICIES)}")])
    return cls(tc)


def reserved_group(tc: TailConfig) -> str | None:
    """The group a tail policy keeps for its long runners before the flip, if any (``ReplicaPool``'s)."""
    return tc.group if tc.active and tc.reserves_group else None


class _Run:
    """A replica's running requests of one job (its current step) that have not moved and have no hint,
    in dispatch order: each has generated no more than the one before it (``SpeedMeter.per_request_at``
    only grows), and its priority to move is what it has generated (``MoveLimits.priority`` without a
    hint). Priced one at a time as the merge takes them (:attr:`head`): after the first that should not
    move, none should."""

    __slots__ = ("r", "ran", "limits", "reqs", "head", "priority")

    def __init__(self, r: Replica, ran: float, limits: MoveLimits, reqs: Iterator[Request]) -> None:
        self.r, self.ran, self.limits, self.reqs = r, ran, limits, reqs
        self.head: Request | None = None
        """The next request of the run that should move (None: none is left)."""
        self.priority = 0.0
        self.pop()

    def pop(self) -> None:
        """Go on to the next request (the head was taken)."""
        req = next(self.reqs, None)
        p = None if req is None else self.limits.priority(self.r.speed.tokens_until(req.est_mark, self.ran))
        if p is None:
            self.head = None
        else:
            self.head, self.priority = req, p


def _oldest(runs: list[_Run], room: int) -> list[tuple[float, int, Request, Replica]]:
    """Of the runs' requests, enough of those that should move, the most generated first, that no request
    left out could be among the ``room`` with the most (ties at the cut included): a merge of the runs
    that looks only at their heads, not at every running request."""
    heap = [(-run.priority, i) for i, run in enumerate(runs) if run.head is not None]
    heapq.heapify(heap)
    out: list[tuple[float, int, Request, Replica]] = []
    while heap:
        neg, i = heapq.heappop(heap)
        if len(out) >= room and -neg < out[room - 1][0]:
            break
        run = runs[i]
        req = run.head
        assert req is not None
        out.append((-neg, -req.seq, req, run.r))
        run.pop()
        if run.head is not None:
            heapq.heappush(heap, (-run.priority, i))
    return out


def _movable(reqs: Iterable[Request], job: str, step: int) -> Iterator[Request]:
    """Of ``reqs`` (a replica's, none with a hint or a move), those of ``job``'s ``step`` that may move."""
    for req in reqs:
        if req.msg.job == job and _may_move(req, step):
            yield req


class TailRouting:
    def __init__(self, tc: TailConfig, run_dir: RunDir, files: FileWriter, pool: ReplicaPool) -> None:
        self.tc = tc
        self.group = tc.group
        self.flip = CountFlip(run_dir, files, tc.threshold, tc.group)
        self.policy: TailPolicy | None = make_tail_policy(tc) if tc.active else None
        self.reserved = reserved_group(tc)
        """The group kept for what the policy sends there before the flip, if any."""
        self._bulk: PoolKey = BULK if self.reserved is not None else None
        self.pool = pool
        self.records: dict[str, StepRecord] = {}
        """Per job: what its current step has revealed."""
        self.inbound: set[str] = set()
        """Requests moving to the tail group that do not run there yet (each holds a slot of its room)."""
        self.work_left: dict[str, tuple[int, WorkLeft]] = {}
        """Per job, with ``trade_margin``: (step, what its last step expects of a running request)."""

    @property
    def active(self) -> bool:
        """Tail routing is on (``tail.active``): a flip, or a policy that moves long runners early."""
        return self.policy is not None

    # ---- steps -----------------------------------------------------------------------------
    def step_begin(self, job: str, step: int, n_sessions: int) -> None:
        self.flip.step_begin(job, step, n_sessions)
        rec = self.records.get(job)
        if rec is None or rec.step != step:
            last = None
            if rec is not None and self.policy is not None:  # the step that ends: all its turns are in
                last = self.policy.long_turn(rec)
                last = rec.last_long if last is None else last
            self.records[job] = StepRecord(step, last)
            work_left = WorkLeft.of(rec) if self.tc.trade_margin is not None else None
            if work_left is not None:
                self.work_left[job] = (step, work_left)

    def session_done(self, job: str, step: int, session_id: str) -> tuple[float, int] | None:
        """Count a finished session; when this flipped the step, the flip's time and count."""
        if not self.flip.session_done(job, step, session_id):
            return None
        st = self.flip.steps[job]
        assert st.flipped_at is not None
        return st.flipped_at, st.flip_count

    def flipped(self, job: str, step: int) -> bool:
        return self.flip.threshold is not None and self.flip.flipped(job, step)

    def _record(self, msg: Generate) -> StepRecord | None:
        rec = self.records.get(msg.job)
        return rec if rec is not None and rec.step == msg.step else None

    # ---- placement -------------------------------------------------------------------------
    def targets(self, req: Request) -> tuple[PoolKey, PoolKey]:
        """Where ``req`` goes: (a pool key, or None for any group; a second key to try when the first
        has no room, or None to wait for it). A request that names its group goes there; what the router
        sent to the tail group goes to the bulk while the tail group has no serving replica."""
        m = req.msg
        if m.group is not None:
            if m.group == self.group and req.named_group is None:
                return self._tail_or_bulk()  # the router moved it there, its client did not ask
            return m.group, None
        if self.policy is None:
            return None, None
        if self.flipped(m.job, m.step):
            return self._tail_or_bulk()
        bulk = self._bulk
        rec = self._record(m)
        if (rec is not None and m.session_id and self.room() > 0
                and self.policy.start_on_tail(rec, m.session_id, m.prompt_key, max(0, hinted(m) - m.resumed_tokens))):
            return self.group, bulk
        return bulk, None

    def _tail_or_bulk(self) -> tuple[PoolKey, PoolKey]:
        """Where the router's own tail placements go (a move, a flipped step's rest): the tail group,
        waiting for its slots; while it has no serving replica (scaled to 0, all of it lost), the bulk."""
        return (self.group, None) if self.pool.members(self.group) else (self._bulk, None)

    def dispatched(self, req: Request, r: Replica, now: float) -> None:
        """``req`` was sent to ``r`` (``now``: monotonic): the origin of its token estimate there."""
        req.est_mark = now
        m = req.msg
        rec = self._record(m)
        if m.expected_tokens and rec is not None:
            rec.hinted = True  # from now on the step's ticks look at hints (a run without any never does)
        if r.group == self.group:
            self.inbound.discard(req.request_id)
            if rec is not None and m.session_id and not self.flipped(m.job, m.step):
                rec.on_tail.add(m.session_id)

    def finished(self, req: Request, tokens: int) -> None:
        """``req`` ended ``ok`` with ``tokens`` output tokens in all (every leg)."""
        m = req.msg
        rec = self._record(m)
        if rec is not None:
            rec.finished(m.session_id, m.prompt_key, tokens)

    def forget(self, req: Request) -> None:
        """``req`` has its Result."""
        self.inbound.discard(req.request_id)

    def target(self, req: Request) -> PoolKey:
        """The pool key ``req`` waits for (None: any group)."""
        return self.targets(req)[0]

    # ---- moves -----------------------------------------------------------------------------
    def tick_s(self) -> float:
        """Seconds to the next look for requests to move: :data:`TICK_S`, longer in proportion past
        :data:`TICK_REPLICAS` replicas, so that the ticks take a bounded share of the router."""
        return TICK_S * max(1.0, len(self.pool.all()) / TICK_REPLICAS)

    def room(self) -> int:
        """Spare slots of the tail group less the moves on their way there."""
        return self.pool.spare_slots(self.group) - len(self.inbound)

    def to_move(self, now: float) -> list[tuple[Request, Replica]]:
        """The running requests to move to the tail group now, as many as it has room for, those with
        the most still to come first (:meth:`MoveLimits.priority`: by their hints, else the oldest):
        after a flip with ``migrate_inflight`` every request of the step; before it, those the policy
        calls long runners. Each holds its room until it runs there."""
        if self.policy is None:
            return []
        room = self.room()
        if room <= 0:
            return []
        # Per job, when its current step's requests move (all of them after a flip with
        # migrate_inflight); this runs every tick, so a step with nothing to move is not scanned.
        limits: dict[str, tuple[int, MoveLimits]] = {}
        for job, rec in self.records.items():
            if self.flipped(job, rec.step):
                limit = EVERYTHING if self.tc.migrate_inflight else None
            else:
                limit = self.policy.move_limits(rec)
            if limit is not None:
                limits[job] = (rec.step, limit)
        if not limits:
            return []
        found: list[tuple[float, int, Request, Replica]] = []
        runs: list[_Run] = []
        for r in self.pool.all():
            if r.group == self.group or not r.serving or not r.inflight:
                continue
            ran = r.speed.per_request_at(now)
            # Requests with a hint or a move are each priced, up to the last of them; the others of each
            # job wait in its run, taken lazily by the merge: those left after the last marked one are
            # read straight from the replica's requests.
            of_job: dict[str, list[Request]] = {}
            marked = r.marked
            seen = 0
            if marked:
                for req in r.inflight.values():
                    seen += 1
                    m = req.msg
                    bare = plain(req)
                    marked -= not bare
                    job_limit = limits.get(m.job)
                    if job_limit is not None and _may_move(req, job_limit[0]):
                        if bare:
                            of_job.setdefault(m.job, []).append(req)
                        else:
                            tokens = len(req.prefix_tokens) + r.speed.tokens_until(req.est_mark, ran)
                            priority = job_limit[1].priority(tokens, hinted(m))
                            if priority is not None:
                                found.append((priority, -req.seq, req, r))
                    if not marked:
                        break
            rest = len(r.inflight) - seen
            for job, (step, limit) in limits.items():
                before = of_job.get(job, ())
                if not before and not rest:
                    continue
                after = _movable(islice(r.inflight.values(), seen, None), job, step)
                runs.append(_Run(r, ran, limit, chain(before, after)))
        found.extend(_oldest(runs, room))
        found = heapq.nlargest(room, found, key=lambda f: (f[0], f[1]))
        moves = [(req, r) for _, _, req, r in found]
        for req, _ in moves:
            self.inbound.add(req.request_id)  # its session joins ``on_tail`` once it runs there
        return moves

    def to_trade(self, now: float) -> list[tuple[Request, Replica, Request, Replica]]:
        """With ``trade_margin`` and the tail group full: (a long runner elsewhere, its replica, a request
        on the tail group, its replica) to trade places (``trade.py``), the runner of most work left
        against the resident of least, while the runner's is larger by the margin. The runner holds the
        place its resident leaves; the resident's session no longer prefers the tail group."""
        if self.tc.trade_margin is None or self.policy is None or self.room() > 0:
            return []
        trades: list[tuple[Request, Replica, Request, Replica]] = []
        for job, rec in self.records.items():
            known = self.work_left.get(job)
            limits = self.policy.move_limits(rec)
            if known is None or known[0] != rec.step or limits is None or self.flipped(job, rec.step):
                continue
            work_left = known[1]
            runners: list[tuple[float, int, Request, Replica]] = []
            residents: list[tuple[float, int, Request, Replica]] = []
            for r in self.pool.all():
                if not r.serving or not r.inflight:
                    continue
                on_tail = r.group == self.group
                ran = r.speed.per_request_at(now)
                young = False  # a plain request here is not a long runner: none dispatched after it is
                for req in r.inflight.values():
                    m = req.msg
                    if m.job != job or m.step != rec.step:
                        continue
                    if young and plain(req):  # only off the tail group is a request young
                        continue
                    if not _can_move(req) or (m.group is not None and not (on_tail and req.moves)):
                        continue  # a request that named its group stays there; one moved there may go
                    tokens = len(req.prefix_tokens) + r.speed.tokens_until(req.est_mark, ran)
                    if not on_tail and limits.priority(tokens, hinted(m)) is None:
                        young = young or plain(req)
                        continue  # not a long runner
                    work = work_left(tokens, len(rec.by_session.get(m.session_id, ())))
                    (residents if on_tail else runners).append((work, req.seq, req, r))
            runners.sort(key=lambda w: (-w[0], w[1]))
            residents.sort(key=lambda w: (w[0], w[1]))
            for (work, _, req, r), (least, _, out, t) in zip(runners, residents, strict=False):
                if work <= least + self.tc.trade_margin:
                    break
                logger.debug("trade: %s (%.0f tokens of work left) for %s (%.0f)", req.request_id, work,
                             out.request_id, least)
                trades.append((req, r, out, t))
                self.inbound.add(req.request_id)
                rec.on_tail.discard(out.msg.session_id)
        return trades

    def progress(self, timeline: Timeline) -> dict[str, StepProgress]:
        """Per job: its current step as far as the router knows (``Status.steps``)."""
        out = {}
        for job, st in self.flip.steps.items():
            tl = timeline.of(job, st.step)
            out[job] = StepProgress(st.step, st.n_sessions, len(st.done), tl.t0 if tl else 0.0,
                                    st.flip_count, st.flipped_at or 0.0, tl.migrated if tl else 0)
        return out

    def adopt_sentinels(self) -> None:
        self.flip.adopt_sentinels()
