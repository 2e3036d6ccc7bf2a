"""Admission by KV budget (``router.kv_budget``): a new session starts on a replica only while the KV its
admitted sessions take there, plus what the new one is expected to take, stays under the budget.

A session is admitted where its first turn is sent and holds its reservation until its ``SessionDone``:
the larger of its context so far and the mean final context of its job's finished sessions (before any
finished: its prompt plus its turn's budget). Its turns move the reservation with them (a move to the
tail group, a spill); a replica that leaves frees its sessions' (they are admitted again where their
next turn goes, without waiting). A session with no request for ``router.kv_idle_s`` (a client that never
says ``SessionDone``) gives its reservation back. Requests without a session are never held.

New sessions are admitted in the fair queue's order within a group: while one waits for budget there,
no later job's new session takes budget in that group (the budget its sessions free builds up for it,
and one larger than a whole budget starts once its replica has fewer sessions than slots).
"""

from __future__ import annotations

from collections.abc import Iterable

from toolkit.router.queue import Request
from toolkit.router.replica import Replica

FINAL_WEIGHT = 0.05
"""Weight of each finished session in its job's running mean of final contexts (an EMA)."""


class _Held:
    __slots__ = ("replica", "tokens", "job", "active_at")

    def __init__(self, replica: Replica, tokens: int, job: str, now: float) -> None:
        self.replica = replica
        self.tokens = tokens
        self.job = job
        self.active_at = now


class KvAdmission:
    def __init__(self, budget: float, idle_s: float = 60.0) -> None:
        self.budget = budget
        """Fraction of a replica's KV cache its admitted sessions may take."""
        self.idle_s = idle_s
        """A session with no request for this long is no longer counted."""
        self.held_back: set[object] = set()
        """The pool keys where a new session found no budget in this dispatch pass: later jobs' new
        sessions wait there too (cleared at each pass)."""
        self.sessions: dict[str, _Held] = {}
        self.used: dict[Replica, int] = {}
        """Tokens reserved per replica."""
        self.count: dict[Replica, int] = {}
        """Sessions admitted per replica."""
        self.final: dict[str, float] = {}
        """Per job: the running mean of its finished sessions' final contexts (tokens)."""
        self.refused = 0
        """Decisions that found no replica with budget for a new session (it waited)."""

    def is_new(self, req: Request) -> bool:
        """``req`` starts a session not admitted anywhere. A turn whose client says it goes on from the
        session's last prompt (``hashes_from``) is not new even if not admitted here: a restarted router's
        resent turns, a session back after ``idle_s``; its context is likely cached, and it is admitted
        where it goes without waiting."""
        sid = req.msg.session_id
        return bool(sid) and sid not in self.sessions and not req.msg.hashes_from

    def expected(self, req: Request) -> int:
        mean = self.final.get(req.job)
        first = req.prompt_len + req.msg.sampling.max_tokens
        return max(req.prompt_len, int(mean)) if mean is not None else first

    def _left(self, r: Replica, need: int) -> float:
        """Budget ``r`` has left once a new session of ``need`` tokens starts there (below 0: it does not
        fit); unbounded while ``r`` has fewer sessions than slots (a slot no session can fill is lost work:
        more KV in use is the better trade) or reports no capacity."""
        cap = r.kv_capacity_tokens
        if cap <= 0 or self.count.get(r, 0) < r.max_inflight:
            return float("inf")
        return self.budget * cap - self.used.get(r, 0) - need

    def fits(self, r: Replica, req: Request) -> bool:
        """A new session ``req`` may start on ``r``."""
        return self._left(r, self.expected(req)) >= 0

    def best(self, candidates: Iterable[Replica], req: Request) -> Replica | None:
        """Of ``candidates``, the one with the most budget left that fits ``req`` (None: it waits)."""
        need = self.expected(req)
        best, best_left = None, -1.0
        for r in candidates:
            left = self._left(r, need)
            if left >= 0 and left > best_left:
                best, best_left = r, left
        if best is None:
            self.refused += 1
        return best

    # ---- what happens to sessions ----------------------------------------------------------------
    def placed(self, req: Request, r: Replica, now: float) -> None:
        """A turn of ``req``'s session was sent to ``r``: it is admitted there (moved, if elsewhere)."""
        sid = req.msg.session_id
        if not sid:
            return
        held = self.sessions.get(sid)
        if held is None:
            held = self.sessions[sid] = _Held(r, self.expected(req), req.job, now)
            self._hold(held)
            return
        held.active_at = now
        held.tokens = self._grow(held, req.prompt_len)
        if held.replica is not r:
            self._release(held)
            held.replica = r
            self._hold(held)

    def answered(self, req: Request, output_tokens: int, now: float) -> None:
        held = self.sessions.get(req.msg.session_id) if req.msg.session_id else None
        if held is not None:
            held.active_at = now
            held.tokens = self._grow(held, req.prompt_len + output_tokens)

    def _grow(self, held: _Held, context: int) -> int:
        if context <= held.tokens:
            return held.tokens
        self.used[held.replica] = self.used.get(held.replica, 0) + context - held.tokens
        return context

    def done(self, session_id: str) -> None:
        """The session ended: its reservation goes, its context counts toward its job's mean."""
        held = self.sessions.pop(session_id, None)
        if held is None:
            return
        self._release(held)
        mean = self.final.get(held.job)
        self.final[held.job] = held.tokens if mean is None else mean + FINAL_WEIGHT * (held.tokens - mean)

    def _hold(self, held: _Held) -> None:
        r = held.replica
        self.used[r] = self.used.get(r, 0) + held.tokens
        self.count[r] = self.count.get(r, 0) + 1

    def _release(self, held: _Held) -> None:
        r = held.replica
        left = self.count.get(r, 0) - 1
        if left > 0:
            self.count[r] = left
            self.used[r] -= held.tokens
        else:
            self.count.pop(r, None)
            self.used.pop(r, None)

    def drop_replica(self, r: Replica) -> None:
        """``r`` left or lost its cache: its sessions are admitted again where their next turn goes."""
        for sid in [s for s, h in self.sessions.items() if h.replica is r]:
            del self.sessions[sid]
        self.used.pop(r, None)
        self.count.pop(r, None)

    def expire(self, now: float, live: set[str]) -> None:
        """Sessions idle for ``idle_s`` with no request in ``live`` (the sessions with one) go."""
        for sid in [s for s, h in self.sessions.items() if now - h.active_at > self.idle_s and s not in live]:
            self._release(self.sessions.pop(sid))
