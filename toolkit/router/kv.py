"""The router's KV part: the index the engines' KV events build (``kv_index.py``), the KV budget new
sessions start under (``kv_admission.py``), and what they are told and count. The router calls it at
each point of a request's and a session's life; the policy and the pool read the index and the budget.
"""

from __future__ import annotations

from collections.abc import Iterable

from toolkit.config import Config, kv_budget, kv_events_on
from toolkit.core import protocol as P
from toolkit.router.kv_admission import KvAdmission
from toolkit.router.kv_index import KvIndex
from toolkit.router.queue import Request
from toolkit.router.replica import Replica, Send

RATE_S = 5.0
"""Events per second are counted over windows of this length."""
EXPIRE_EVERY_S = 5.0


class KvRouting:
    def __init__(self, cfg: Config, send_to_replica: Send) -> None:
        self._send = send_to_replica
        self.index = KvIndex(self._resync) if kv_events_on(cfg) else None
        budget = kv_budget(cfg)
        self.admission = KvAdmission(budget, cfg.router.kv_idle_s) if budget is not None else None
        self.predicted_tokens = 0
        """Prompt tokens the index said were cached on the replica each request went to."""
        self.dispatched_tokens = 0
        self._rate = (0.0, 0, 0.0)
        """(window start, events at it, the last window's rate)."""
        self._expired_at = 0.0

    @property
    def on(self) -> bool:
        return self.index is not None or self.admission is not None

    def _resync(self, r: Replica, why: str) -> None:
        self._send(r.identity, P.KvResync(why))

    # ---- messages from replicas -------------------------------------------------------------------
    def events(self, r: Replica | None, msg: P.KvEvents) -> None:
        if r is not None and self.index is not None:
            self.index.apply(r, msg)

    def heard(self, r: Replica | None, seq: int) -> None:
        """``r``'s heartbeat: its last events batch is ``seq``."""
        if r is not None and self.index is not None and seq:
            self.index.heard(r, seq)

    def snapshot(self, r: Replica | None, msg: P.KvSnapshot) -> None:
        if r is not None and self.index is not None:
            self.index.snapshot(r, msg)

    # ---- a request's and a session's life ---------------------------------------------------------
    def submitted(self, req: Request) -> None:
        """On arrival: whether it starts a session (the budget), and its prompt's block hashes, so that a
        decision while it waits only reads the index."""
        if self.admission is not None:
            req.new_session = self.admission.is_new(req)
        if self.index is not None:
            for bs in self.index.block_sizes:
                self.index.hashes(req, bs)

    def sent(self, req: Request, r: Replica, now: float) -> None:
        if self.admission is not None:
            self.admission.placed(req, r, now)
            req.new_session = False  # admitted: moved or queued again, it takes its reservation along
        if self.index is not None and r.kv_slot >= 0:
            found = req.kv_found
            self.predicted_tokens += found[1] if found is not None and found[0] is r else self.index.prefix_on(req, r)
            self.dispatched_tokens += len(req.msg.prompt_token_ids)
            req.kv_found = None

    def answered(self, req: Request, output_tokens: int, now: float) -> None:
        if self.admission is not None:
            self.admission.answered(req, output_tokens, now)

    def session_done(self, session_id: str) -> None:
        if self.admission is not None:
            self.admission.done(session_id)
        if self.index is not None:
            self.index.forget_session(session_id)

    def sweep(self, now: float, live: Iterable[Request]) -> None:
        if self.index is not None:
            start, events, rate = self._rate
            if now - start >= RATE_S:
                self._rate = (now, self.index.events, (self.index.events - events) / (now - start) if start else 0.0)
        if self.admission is not None and now - self._expired_at >= EXPIRE_EVERY_S:
            self._expired_at = now
            self.admission.expire(now, {q.msg.session_id for q in live})

    # ---- status -----------------------------------------------------------------------------------
    def status(self, replicas: Iterable[Replica], queued: Iterable[Request]) -> P.KvStatus | None:
        if not self.on:
            return None
        replicas = list(replicas)
        hits = sum(r.stats.prefix_hits for r in replicas)
        queries = sum(r.stats.prefix_queries for r in replicas)
        out = P.KvStatus(reported_hit=hits / queries if queries else 0.0)
        if self.index is not None:
            out.index_blocks = self.index.size
            out.cached_blocks = {r.replica_id: self.index.cached_blocks(r) for r in replicas if r.kv_slot >= 0}
            out.events = self.index.events
            out.events_per_s = self._rate[2]
            out.resyncs = self.index.resyncs
            out.client_hashed = self.index.client_hashed
            out.predicted_tokens, out.dispatched_tokens = self.predicted_tokens, self.dispatched_tokens
            out.predicted_hit = self.predicted_tokens / self.dispatched_tokens if self.dispatched_tokens else 0.0
        if self.admission is not None:
            adm = self.admission
            out.admitted_sessions = len(adm.sessions)
            out.reserved_tokens = {r.replica_id: n for r, n in adm.used.items()}
            out.waiting_sessions = sum(1 for q in queued if q.new_session)
        return out
