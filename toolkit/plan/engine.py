"""The sim engine in virtual time, stepping by stretches: between two events (a request arrives or is
aborted, one finishes) every running sequence gains one token a step and the context grows by the
batch each step, so the stretch's duration is a sum in closed form over the sim's own
step model (``toolkit.engine.step_model``). The engine decides like the sim does: it admits waiting requests at step boundaries up to
``max_num_seqs``, plans each request's tokens with ``plan_output``, looks prompts up in the same
``PrefixCache``, and lands a moved request's KV after its link time. A twin replica runs thousands of
steps in a few events."""

from __future__ import annotations

import asyncio
import heapq
from collections import OrderedDict, deque
from collections.abc import Callable

from toolkit.config import SimEngineConfig
from toolkit.core.blocks import ROOT, chain_from
from toolkit.core.errors import ToolkitError
from toolkit.core.protocol import Generate, ReplicaStats, Result
from toolkit.engine.plans import PLAN_FIELDS, plan_output
from toolkit.engine.prefix_cache import PrefixCache
from toolkit.engine.step_model import step_seconds
from toolkit.plan.loop import VirtualLoop

Answer = Callable[[Result], None]
Plan = Callable[[SimEngineConfig, Generate], tuple[list[int], list[float], str]]
"""A request's tokens, logprobs and finish reason: the sim's ``plan_output``, or a replay's."""


def _plans_alike(a: SimEngineConfig, b: SimEngineConfig) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in PLAN_FIELDS)


class MovedPlans:
    """Each running request's plan, kept from its first leg until it finishes, so that a continuation
    (``resumed_tokens``) on an engine that plans alike (the same :data:`PLAN_FIELDS`, which is all that
    ``plan_output`` and a replay's plan read) takes the rest of it instead of planning again (``plan_output``
    plans a continuation as its first leg and cuts it: the same tokens). The twin's engines share one; a
    request cancelled for good (not moved) stays in it as long as the twin."""

    def __init__(self, plan: Plan = plan_output) -> None:
        self.plan = plan
        self._first: dict[str, tuple[SimEngineConfig, tuple[list[int], list[float], str]]] = {}

    def __call__(self, cfg: SimEngineConfig, req: Generate) -> tuple[list[int], list[float], str]:
        k = req.resumed_tokens
        if k > 0:
            kept = self._first.get(req.request_id)
            if kept is not None and (kept[0] is cfg or _plans_alike(kept[0], cfg)):
                tokens, logprobs, finish = kept[1]
                return tokens[k:], logprobs[k:], finish
            return self.plan(cfg, req)
        out = self._first[req.request_id] = (cfg, self.plan(cfg, req))
        return out[1]

    def finished(self, request_id: str) -> None:
        """``request_id`` ended (not cancelled): no leg of it follows."""
        self._first.pop(request_id, None)


class _Seq:
    __slots__ = ("req", "tokens", "logprobs", "finish", "produced", "cached", "done", "hashes", "base", "end")

    def __init__(self, req: Generate, tokens: list[int], logprobs: list[float], finish: str) -> None:
        self.req = req
        self.tokens = tokens
        self.logprobs = logprobs
        self.finish = finish
        self.produced = 0
        self.cached = 0
        self.done = False
        self.hashes: list[int] = []
        """Its prompt's block hashes (the prefix cache's), once looked up."""
        self.base = 0
        """The engine's step count when it was admitted: while it runs it has made ``steps - base`` tokens."""
        self.end = 0
        """The engine's step count at which it finishes."""


class _Stretch:
    """Steps from ``start``: ``n`` sequences, ``ctx0`` context tokens in the first step, which also
    prefills ``prefill`` tokens; step ``i`` lasts ``a + b * (ctx0 + i * n)`` (+ ``p`` for the first),
    or exactly ``fixed`` for a one-step stretch that finishes a step already under way."""

    __slots__ = ("start", "n", "ctx0", "a", "b", "p", "prefill", "k", "fixed", "timer")

    def __init__(self, start: float, n: int, ctx0: int, a: float, b: float, p: float, prefill: int, k: int,
                 fixed: float | None = None) -> None:
        self.start, self.n, self.ctx0, self.a, self.b, self.p, self.k = start, n, ctx0, a, b, p, k
        self.prefill = prefill
        self.fixed = fixed
        self.timer: asyncio.TimerHandle | None = None

    def elapsed(self, j: int) -> float:
        """Seconds of its first ``j`` steps."""
        if j <= 0:
            return 0.0
        if self.fixed is not None:
            return self.fixed
        return j * self.a + self.b * (j * self.ctx0 + self.n * j * (j - 1) / 2) + self.p

    def done_by(self, t: float) -> int:
        """Steps finished by time ``t``."""
        lo, hi = 0, self.k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.start + self.elapsed(mid) <= t + 1e-12:
                lo = mid
            else:
                hi = mid - 1
        return lo


class TwinEngine:
    def __init__(self, cfg: SimEngineConfig, loop: VirtualLoop, answer: Answer,
                 plan: Plan | MovedPlans = plan_output) -> None:
        self.cfg = cfg
        self.plans = plan if isinstance(plan, MovedPlans) else MovedPlans(plan)
        self.loop = loop
        self.answer = answer
        """Takes each request's one Result."""
        self.cache = PrefixCache(cfg.block_size, cfg.kv_cache_tokens)
        self.waiting: deque[_Seq] = deque()
        self.running: dict[_Seq, None] = {}
        """In admission order. A running sequence's tokens are counted from the engine's steps, not one by
        one: every stretch costs the same whatever the batch."""
        self._ends: list[tuple[int, int, _Seq]] = []
        """A heap of the running sequences' ``(end, admission number)``: the next to finish."""
        self._admitted = 0
        self._prompts = 0
        """The running sequences' prompt tokens, summed."""
        self._bases = 0
        """Their ``base`` s, summed: the running context is ``_prompts + len(running) * steps - _bases``."""
        self.by_id: dict[str, _Seq] = {}
        self.prefix_hits = self.prefix_queries = 0
        self.steps = self.generated_tokens = self.prefill_tokens = 0
        self.model_s = self.active_s = 0.0
        self._active_since: float | None = None
        self._stretch: _Stretch | None = None
        self._boundary_due = False
        self._chains: OrderedDict[str, tuple[int, tuple[int, ...], list[int]]] = OrderedDict()
        """Per session (the latest few): its last context's length, last whole block and block hashes. A
        session's next prompt extends its last context, so its hashes go on from there: hashing every
        prompt whole would cost the twin more than anything else it does per request."""
        scale = cfg.time_scale
        self._s0 = step_seconds(cfg, 0)
        self._a = self._s0 * scale
        self._b = (step_seconds(cfg, 1) - self._s0) * scale

    # ---- requests in ---------------------------------------------------------------------------------
    def submit(self, req: Generate) -> None:
        c = self.cfg
        # Its prompt is within this engine's limits: the router checks every request it dispatches
        # against the limits its replica registered (``limit_error``), which are these.
        if req.sampling.structured is not None:
            self._later(Result(request_id=req.request_id, status="client_error",
                               error="the twin's engines plan no structured outputs"))
            return
        try:
            tokens, logprobs, finish = self.plans(c, req)
        except ToolkitError as exc:
            self._later(Result(request_id=req.request_id, status="client_error", error=str(exc)))
            return
        seq = _Seq(req, tokens, logprobs, finish)
        self.by_id[req.request_id] = seq
        if req.kv_tokens > 0:  # its KV crosses the link first, without holding up the running batch
            link_s = req.kv_tokens * c.kv_bytes_per_token / c.kv_link_bytes_per_s
            self.loop.later(link_s * c.time_scale, self._landed, seq)
        else:
            self._admit(seq)

    def _later(self, res: Result) -> None:
        self.loop.soon(self.answer, res)

    def _landed(self, seq: _Seq) -> None:
        if not seq.done:
            prompt = seq.req.prompt_token_ids
            seq.hashes = self._hashes(seq.req.session_id, prompt)
            seq.cached = self.cache.match(prompt, seq.hashes)
            self.cache.store(seq.hashes[: seq.req.kv_tokens // self.cache.block_size])
            self._admit(seq)

    def _admit(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        if self._stretch is None:
            if not self._boundary_due:  # idle: the next step begins now (with whatever else arrives now)
                self._boundary_due = True
                self.loop.soon(self._boundary)
        else:
            self._cut()

    def abort(self, request_id: str) -> None:
        seq = self.by_id.get(request_id)
        if seq is None or seq.done:
            return
        if seq in self.running:
            self._cut()  # the tokens of the steps it finished are its own
            if seq.done:  # it finished just now
                return
            self._leave(seq)
            self._finish(seq, "cancelled", "abort", computed=True)
        else:
            self._finish(seq, "cancelled", "abort", computed=False)

    # ---- steps ---------------------------------------------------------------------------------------
    def _cut(self) -> None:
        """Something changed mid-stretch: the steps done so far count, the one under way ends where it
        was going to, and the boundary after it sees the change."""
        st = self._stretch
        if st is None:
            return
        j = st.done_by(self.loop.now)
        if j >= st.k:  # it ends now: its end comes first
            assert st.timer is not None
            st.timer.cancel()
            self._end()
            return
        if j == 0 and st.fixed is not None:
            return  # one step, under way
        self._advance(st, j)
        assert st.timer is not None
        st.timer.cancel()
        under_way = st.elapsed(j + 1) - st.elapsed(j)
        prefill = st.prefill if j == 0 else 0  # the first step prefills
        nxt = _Stretch(st.start + st.elapsed(j), st.n, 0, 0.0, 0.0, 0.0, prefill, 1, fixed=under_way)
        self._stretch = nxt
        nxt.timer = self.loop.at(nxt.start + under_way, self._end)

    def _advance(self, st: _Stretch, j: int) -> None:
        """Count ``j`` finished steps of ``st``: every running sequence gained ``j`` tokens."""
        if j <= 0:
            return
        self.steps += j
        self.generated_tokens += j * st.n
        self.model_s += st.elapsed(j)
        self.prefill_tokens += st.prefill

    def _end(self) -> None:
        st = self._stretch
        assert st is not None
        self._advance(st, st.k)
        self._stretch = None
        ends = self._ends
        while ends and ends[0][0] <= self.steps:
            seq = heapq.heappop(ends)[2]
            if not seq.done:
                self._leave(seq)
                self._finish(seq, "ok", seq.finish, computed=True)
        self._boundary()

    def _leave(self, seq: _Seq) -> None:
        """``seq`` stops running: its tokens are the steps it ran (all of them if it finished)."""
        seq.produced = min(self.steps - seq.base, len(seq.tokens))
        del self.running[seq]
        self._prompts -= len(seq.req.prompt_token_ids)
        self._bases -= seq.base

    def _boundary(self) -> None:
        self._boundary_due = False
        if self._stretch is not None:
            return
        c = self.cfg
        now = self.loop.now
        prefill = 0
        while self.waiting and len(self.running) < c.max_num_seqs:
            seq = self.waiting.popleft()
            if seq.done:
                continue
            prompt = seq.req.prompt_token_ids
            if not seq.hashes:  # (a request whose KV landed has them)
                seq.hashes = self._hashes(seq.req.session_id, prompt)
            found = self.cache.match(prompt, seq.hashes)
            prefill += len(prompt) - found
            came = max(0, found - seq.cached) if seq.req.kv_tokens > 0 else 0
            seq.cached = found - came
            self.prefix_queries += len(prompt) - came
            self.prefix_hits += seq.cached
            seq.base, seq.end = self.steps, self.steps + max(1, len(seq.tokens))
            self._admitted += 1
            heapq.heappush(self._ends, (seq.end, self._admitted, seq))
            self.running[seq] = None
            self._prompts += len(prompt)
            self._bases += seq.base
        if not self.running:
            if self._active_since is not None:
                self.active_s += now - self._active_since
                self._active_since = None
            return
        if self._active_since is None:
            self._active_since = now
        n = len(self.running)
        ctx0 = self._prompts + n * self.steps - self._bases
        ends = self._ends
        while ends[0][2].done:  # aborted: it left the batch already
            heapq.heappop(ends)
        k = ends[0][0] - self.steps
        p = (step_seconds(c, 0, prefill) - self._s0) * c.time_scale if prefill else 0.0
        st = _Stretch(now, n, ctx0, self._a, self._b, p, prefill, k)
        self._stretch = st
        st.timer = self.loop.at(now + st.elapsed(k), self._end)

    def _hashes(self, session: str, tokens: list[int]) -> list[int]:
        """``tokens``' block hashes, going on from the session's last context where it extends it."""
        bs = self.cache.block_size
        known = self._chains.get(session) if session else None
        start: list[int] | None = None
        if known is not None:
            length, last, hashes = known
            k = length // bs
            if len(tokens) >= length and (k == 0 or tuple(tokens[(k - 1) * bs : k * bs]) == last):
                start = hashes
        return self.cache.hashes(tokens, start)

    def _remember(self, session: str, prompt: list[int], out: list[int], hashes: list[int]) -> None:
        """``session``'s last context is ``prompt`` then ``out``, whose whole blocks hash to ``hashes``."""
        if not session:
            return
        bs, n = self.cache.block_size, len(prompt)
        k = (n + len(out)) // bs
        lo = (k - 1) * bs
        last = prompt[lo : lo + bs] + out[max(0, lo - n) : max(0, lo + bs - n)] if k else []
        self._chains[session] = (n + len(out), tuple(last), hashes)
        self._chains.move_to_end(session)
        while len(self._chains) > 4 * self.cfg.max_num_seqs:
            self._chains.popitem(last=False)

    def _finish(self, seq: _Seq, status: str, finish: str, computed: bool) -> None:
        n = seq.produced
        whole = n == len(seq.tokens)  # (its plan's lists are not changed after: no copy of them)
        out = seq.tokens if whole else seq.tokens[:n]
        if computed:  # its context (prompt and output) into the cache, without a copy of it whole
            prompt, bs = seq.req.prompt_token_ids, self.cache.block_size
            known = seq.hashes  # (its prompt's whole blocks', if it was looked up)
            start = len(known) * bs
            hashes = known + chain_from(known[-1] if known else ROOT, prompt[start:] + out, bs)
            self.cache.store(hashes)
            self._remember(seq.req.session_id, prompt, out, hashes)
        seq.done = True
        self.by_id.pop(seq.req.request_id, None)
        if status != "cancelled":
            self.plans.finished(seq.req.request_id)
        self.answer(Result(
            request_id=seq.req.request_id, status=status, output_token_ids=out,
            logprobs=(seq.logprobs if whole else seq.logprobs[:n]) if seq.req.sampling.logprobs else [],
            finish_reason=finish,
            cached_tokens=seq.cached, weight_version=0, weight_versions=[0]))

    # ---- what its heartbeats carry -------------------------------------------------------------------
    def stats(self) -> ReplicaStats:
        now = self.loop.now
        st = self._stretch
        j = st.done_by(now) if st is not None else 0
        n = st.n if st is not None else 0
        ctx = self._prompts + len(self.running) * (self.steps + j) - self._bases
        active = self.active_s + (now - self._active_since if self._active_since is not None else 0.0)
        return ReplicaStats(
            running=len(self.running), waiting=sum(1 for s in self.waiting if not s.done),
            kv_usage=min(1.0, ctx / self.cfg.kv_cache_tokens), prefix_hits=self.prefix_hits,
            prefix_queries=self.prefix_queries, weight_version=0, generated_tokens=self.generated_tokens + j * n,
            engine_steps=self.steps + j, prefill_tokens=self.prefill_tokens,
            model_s=self.model_s + (st.elapsed(j) if st is not None else 0.0), active_s=active)

    def halt(self) -> None:
        """Stop stepping for good (its replica died): nothing it holds ever finishes."""
        if self._stretch is not None and self._stretch.timer is not None:
            self._stretch.timer.cancel()
        self._stretch = None
        self.waiting.clear()
        self.running.clear()
        self._ends.clear()
        self.answer = lambda res: None
