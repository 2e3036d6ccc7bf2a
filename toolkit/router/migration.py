"""Requests that move while they run, the router's part: to the tail group (a long runner, or after the
flip with ``tail.migrate_inflight``: ``toolkit/router/tail/routing.py`` picks them) and off a drained
replica (``Drain`` with ``migrate``).

A moving request is aborted on its replica and stays in that replica's slots until its partial Result
(``cancelled``) comes back; then it continues on its target group from where it stopped: its prompt is
the original prompt plus the tokens so far, its budget what is left (with ``tail.move=kv`` its
``kv_tokens`` say that whole context arrives as KV, not to be prefilled). Its client gets one Result with
the tokens, logprobs and weight versions of every leg, in order, so no token is lost or generated twice.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

import msgspec

from toolkit.core import protocol as P
from toolkit.router.queue import FairQueue, Request
from toolkit.router.replica import Replica, Send
from toolkit.router.timeline import Timeline

logger = logging.getLogger(__name__)


def can_continue(m: P.Generate) -> bool:
    """Whether ``m`` can stop and go on elsewhere from its tokens so far. Not with structured output:
    the engine would start its grammar afresh after the partial output (a second JSON value after
    half of one); nor with ``n`` > 1: a continuation carries one sample's tokens. Such a request
    finishes where it runs."""
    return m.sampling.structured is None and m.sampling.n == 1


class Migrations:
    def __init__(self, kv_moves: bool, send_to_replica: Send, queue: FairQueue, timeline: Timeline) -> None:
        self.kv_moves = kv_moves
        """A continuation brings its context as KV (``moves_carry_kv``), not to be prefilled."""
        self.send = send_to_replica
        self.queue = queue
        self.timeline = timeline
        self.events: Counter[str] = Counter()
        """Moves by reason: ``migrated`` (a flip's), ``migrated:<why>`` (age, trade, drain...)."""

    def start(self, req: Request, r: Replica, why: str, group: str | None) -> None:
        """Abort ``req`` on ``r``; its partial Result (``cancelled``) continues it on ``group`` (None:
        any group). It stays in ``r``'s slots until that Result comes back, so no token is lost."""
        req.migrating = why
        req.migrate_group = group
        self.send(r.identity, P.Abort(req.request_id))

    def resume(self, req: Request, res: P.Result, why: str) -> None:
        """``req``'s partial Result came back: queue its continuation, at the front of its job's queue."""
        out = res.output_token_ids
        if req.first_cached < 0:
            req.first_cached = min(res.cached_tokens, req.prompt_len)
        req.prefix_tokens.extend(out)
        req.prefix_logprobs.extend(_leg_logprobs(req, res))
        if out:  # a leg without tokens generated nothing with its weights
            req.prefix_versions = P.join_versions(req.prefix_versions, res.weight_versions or [res.weight_version])
        m = req.msg
        remaining = m.sampling.max_tokens - len(out)  # > 0: the router continues only what has budget left
        cont = msgspec.structs.replace(
            m, prompt_token_ids=m.prompt_token_ids + out, group=req.migrate_group,
            sampling=msgspec.structs.replace(m.sampling, max_tokens=remaining),
            resumed_tokens=m.resumed_tokens + len(out),
            # With tail.move=kv its KV goes with it: all of its context, the replica it left computed it.
            kv_tokens=len(m.prompt_token_ids) + len(out) if self.kv_moves else 0,
        )
        req.msg = cont
        req.replica = None  # queued again: a deadline or an abort now finds it in the queue
        req.payload = P._encoder.encode(cont)
        if req.ids_below and out and (min(out) < 0 or max(out) >= req.ids_below):
            req.ids_below = 0  # its replica's ids, checked again where it goes next
        req.moves += 1
        if why != "drain":
            self.timeline.migrated(m.job, m.step)
        self.events["migrated" if why == "tail" else f"migrated:{why}"] += 1
        self.queue.requeue_front([req])

    def merged(self, req: Request, res: P.Result) -> bytes:
        """One Result for a request that moved: the tokens, logprobs and weight versions of every leg, in order."""
        lps = _leg_logprobs(req, res)
        last = (res.weight_versions or [res.weight_version]) if res.output_token_ids else []
        merged = msgspec.structs.replace(
            res, output_token_ids=req.prefix_tokens + res.output_token_ids,
            logprobs=req.prefix_logprobs + lps,
            # Cached tokens of the original prompt where it was prefilled: on its first leg. What a move
            # recomputes (or brings as KV) is the move's cost, in the step's time, not the prompt's.
            cached_tokens=req.first_cached if req.first_cached >= 0 else min(res.cached_tokens, req.prompt_len),
            weight_versions=P.join_versions(req.prefix_versions, last) or res.weight_versions,
        )
        return P._encoder.encode(merged)


def _leg_logprobs(req: Request, res: P.Result) -> list[float]:
    """A leg's logprobs, one a token (NaN where an engine sent none: unknown, never a made-up
    probability), or none if the client asked for none."""
    if not req.msg.sampling.logprobs:
        return []
    out = res.output_token_ids
    return res.logprobs if len(res.logprobs) == len(out) else [math.nan] * len(out)
