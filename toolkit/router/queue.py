"""Requests waiting in the router, served fairly between jobs.

Dispatch order: one request from each job in turn, starting with the job served longest ago; oldest
first within a job. A request put back after its replica died goes to the front of its job's queue.
Requests are bucketed by the group they name (None: none named, tail routing places them), so a full
group never blocks a job's requests for another group; apart when they start a session that waits
for a KV budget, so those never block the turns of sessions already running; and apart when they
were in flight at a death (suspects, placed one to a replica), so those never block the rest.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterator
from typing import Any, TypeVar

from toolkit.core.protocol import Generate

T = TypeVar("T")


class Request:
    __slots__ = (
        "request_id", "msg", "payload", "client", "job", "seq", "deaths", "replica",
        "t_submit", "t_dispatch", "done", "dispatches", "ids_below",
        "migrating", "migrate_group", "client_aborted", "prefix_tokens", "prefix_logprobs", "prefix_versions",
        "prompt_len", "est_mark", "moves", "group", "first_cached", "named_group", "kv_hashes", "kv_found", "new_session",
    )

    def __init__(self, msg: Generate, payload: bytes, client: bytes, job: str, seq: int, now: float) -> None:
        self.request_id = msg.request_id
        self.msg = msg
        self.payload = payload
        self.client = client
        self.job = job
        self.seq = seq
        self.deaths: tuple[str, ...] = ()
        """The deaths it was in flight at, in order ("replica: why" each): the poison's error names them."""
        self.replica: str | None = None
        self.t_submit = now
        self.t_dispatch = 0.0
        self.done = False
        self.dispatches = 0
        self.ids_below = 0
        """Its prompt's token ids are known to be in ``[0, ids_below)`` (0: not known yet): checked once
        against a vocabulary, they need no second look for a replica whose vocabulary is as large."""
        # Migration (a tail flip, a drained replica): why it was aborted ("" = it was not), the
        # group its continuation targets, and the tokens generated before it moved.
        self.migrating = ""
        self.migrate_group: str | None = None
        self.client_aborted = False
        self.prefix_tokens: list[int] = []
        self.prefix_logprobs: list[float] = []
        self.prefix_versions: list[int] = []  # weight versions of prefix_tokens, in order
        self.prompt_len = len(msg.prompt_token_ids)
        self.first_cached = -1  # cached tokens of its prompt where it first ran, once it has moved
        # When it was dispatched (monotonic): its tokens there are estimated from then (router/speed.py).
        self.est_mark = 0.0
        self.moves = 0
        self.group = ""  # the group of the replica it was last sent to
        # The group its client named (None: any). A move's continuation names the group the router
        # moved it to in ``msg.group``; this one never changes.
        self.named_group = msg.group
        self.kv_hashes: dict[int, list[int]] = {}
        """Its prompt's block hashes by block size (``kv_index.py``), once a decision needed them."""
        self.kv_found: tuple[Any, int] | None = None
        """The replica ``kv_aware`` found its longest cached prefix on (a ``Replica``: replica.py imports this
        module), and that prefix in tokens."""
        self.new_session = False
        """It starts a session not admitted to any replica (``router.kv_budget``): it waits apart from the
        admitted sessions' turns, so those go while it waits for room."""


def hinted(m: Generate) -> int:
    """``m``'s length hint for its whole turn (0: none), at most what its budget lets it generate."""
    return min(m.expected_tokens, m.sampling.max_tokens + m.resumed_tokens)


def plain(req: Request) -> bool:
    """``req`` has no length hint and has not moved (fixed while it runs: a move changes it between two
    runs). The tail's ticks price such a request by its age alone (``routing._Run``)."""
    return not req.prefix_tokens and not hinted(req.msg)


BucketKey = tuple[str | None, bool, bool]
"""The group a request names, whether it starts a session waiting for admission, whether it is a suspect."""

COMPACT_AT = 64
"""Requests taken out of a job's queue (aborted, expired...) that wait for its buckets to be rebuilt
without them, once they outnumber its live requests too."""


class JobQueue:
    __slots__ = ("name", "buckets", "size", "gone", "scan")

    def __init__(self, name: str, scan: int = 1) -> None:
        self.name = name
        self.buckets: dict[BucketKey, deque[Request]] = {}
        self.size = 0
        """Its requests waiting (not those taken out, still in a bucket until they reach its head)."""
        self.gone = 0
        """Requests taken out, still in a bucket."""
        self.scan = scan
        """How many requests of a bucket may be tried, from its head (see :class:`FairQueue`)."""

    def push(self, req: Request, front: bool = False) -> None:
        bucket = self.buckets.setdefault((req.msg.group, req.new_session, bool(req.deaths)), deque())
        if front:
            bucket.appendleft(req)
        else:
            bucket.append(req)
        self.size += 1

    def discard(self) -> None:
        """One of its requests was taken out (marked done): dropped lazily, or all at once when they are many."""
        self.size -= 1
        self.gone += 1
        if self.gone > COMPACT_AT and self.gone > self.size:
            for key, bucket in self.buckets.items():
                self.buckets[key] = deque(r for r in bucket if not r.done)
            self.gone = 0

    def _clean_head(self, bucket: deque[Request]) -> Request | None:
        while bucket and bucket[0].done:
            bucket.popleft()
            self.gone -= 1
        return bucket[0] if bucket else None

    def pop_dispatchable(self, choose: Callable[[Request], T | None]) -> tuple[Request, T] | None:
        """Remove and return the oldest request that ``choose`` finds a place for, with that place:
        of each bucket the first of its first ``scan`` requests that has one."""
        best: tuple[Request, T] | None = None
        best_bucket: deque[Request] | None = None
        best_at = 0
        for bucket in self.buckets.values():
            if self._clean_head(bucket) is None:
                continue
            for at in range(min(len(bucket), self.scan)):
                req = bucket[at]
                # Put-back requests carry their original seq, so "oldest" stays the submission order.
                if best is not None and req.seq >= best[0].seq:
                    break
                if req.done:
                    continue
                pick = choose(req)
                if pick is not None:
                    best, best_bucket, best_at = (req, pick), bucket, at
                    break
        if best is None or best_bucket is None:
            return None
        del best_bucket[best_at]
        self.size -= 1
        return best


class FairQueue:
    def __init__(self, scan: int = 1) -> None:
        # Ordered by last service: the first job is the one served longest ago.
        self.jobs: OrderedDict[str, JobQueue] = OrderedDict()
        self.size = 0
        self.scan = scan
        """Requests of a job's bucket tried in order, from its head, for one that has a place: 1 (the
        head alone) unless requests may wait for a replica of their own (``router.affinity=wait``),
        when those behind one go meanwhile."""

    def push(self, req: Request, front: bool = False) -> None:
        q = self.jobs.get(req.job)
        if q is None:
            q = self.jobs[req.job] = JobQueue(req.job, self.scan)
            # A new job has never been served: it goes first.
            self.jobs.move_to_end(req.job, last=False)
        q.push(req, front)
        self.size += 1

    def requeue_front(self, reqs: list[Request]) -> None:
        """Put back requests in their original order at the front of their jobs' queues."""
        for req in sorted(reqs, key=lambda r: r.seq, reverse=True):
            self.push(req, front=True)

    def discard(self, req: Request) -> None:
        """Take a queued request out (marked done; :meth:`JobQueue.discard`)."""
        if not req.done:
            req.done = True
            self.size -= 1
            q = self.jobs.get(req.job)
            if q is not None:
                q.discard()

    def pop_round(self, choose: Callable[[Request], T | None]) -> Iterator[tuple[Request, T]]:
        """One pass over the jobs, longest-unserved first, yielding at most one request per job,
        with the place ``choose`` found for it."""
        for name in list(self.jobs):
            q = self.jobs[name]
            if q.size == 0:
                continue
            got = q.pop_dispatchable(choose)
            if got is None:
                continue
            self.size -= 1
            # Served now: to the back of the line. Empty jobs keep their place in the order, so a
            # job that submits one turn at a time is not treated as never served.
            self.jobs.move_to_end(name)
            yield got
        if len(self.jobs) > 1024:
            for name in [n for n, q in self.jobs.items() if q.size == 0]:
                del self.jobs[name]

    def depths(self) -> list[tuple[str, int]]:
        """(job, requests waiting) for every job in the queue's order."""
        return [(name, q.size) for name, q in self.jobs.items()]

    def waiting_for(self, groups: Collection[str | None]) -> Iterator[Request]:
        """Queued requests of the buckets of ``groups`` (the group a request names; None: unnamed)."""
        for q in list(self.jobs.values()):
            for g in groups:
                for new in (False, True):
                    for suspect in (False, True):
                        bucket = q.buckets.get((g, new, suspect))
                        if bucket:
                            yield from (r for r in bucket if not r.done)
