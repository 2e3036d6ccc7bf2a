"""The log of a rank's generation requests: one row per request, gathered to rank 0 as flat columns;
and the rank's open step, which a session that outlives the step it started in reads at each request."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from toolkit.core.protocol import STATUSES, Result, Route
from toolkit.session.columns import Columns

ROW = (("latency_s", np.float64), ("done_at", np.float64), ("queue_s", np.float64), ("dispatched_at", np.float64),
       ("group", np.int16), ("status", np.int8), ("prompt_tokens", np.int64), ("cached_tokens", np.int64),
       ("output_tokens", np.int64), ("session", np.int64), ("moves", np.int64), ("started_step", np.int64))
"""A request's row, in order: each field's column name and type (``group``: a name in the row, its
index among the groups in the column). A session is ``(started_step, session)``: a step closed on a
count also runs sessions carried from earlier steps, whose indexes repeat the step's own."""


class RequestLog:
    """One row per generation request of this rank's sessions (gathered as flat arrays)."""

    def __init__(self, observe: Callable[[Result, float], None] | None = None) -> None:
        self.rows: list[tuple[float, float, float, float, str, int, int, int, int, int, int, int]] = []
        self.sessions_done_at: list[float] = []
        self.observe = observe
        """Called with each Result and its latency (the rank's metrics)."""

    def add(self, res: Result, route: Route | None, prompt_len: int, sent_at: float, done_at: float,
            session: int, started_step: int) -> None:
        """One request of session ``session`` (its index in step ``started_step``, where it began) sent at
        ``sent_at``."""
        if self.observe is not None:
            self.observe(res, done_at - sent_at)
        self.rows.append((
            done_at - sent_at,
            done_at,
            route.queue_s if route else 0.0,
            route.dispatched_at if route else 0.0,
            res.group,
            STATUSES.index(res.status) if res.status in STATUSES else len(STATUSES),
            prompt_len,
            res.cached_tokens,
            len(res.output_token_ids),
            session,
            route.moves if route else 0,
            started_step,
        ))

    def columns(self, group_names: list[str]) -> Columns:
        code = {g: i for i, g in enumerate(group_names)}
        # One transpose in C, then an array per field (a comprehension a field cost the twin's step of
        # 16,384 sessions 3%).
        cols = list(zip(*self.rows, strict=True)) if self.rows else [()] * len(ROW)
        out: Columns = {}
        for (name, dtype), col in zip(ROW, cols, strict=True):
            out[name] = np.array([code.get(g, -1) for g in col] if name == "group" else col, dtype=dtype)
        # Its own length (one per session), gathered like the rest.
        out["session_done_at"] = np.array(self.sessions_done_at, dtype=np.float64)
        return out


class OpenStep:
    """The step a rank is collecting and its request log. With ``rollout.close=count`` a session runs on
    across step boundaries: each of its requests names the step it may land in (the tail flip and the
    fair queue count it there) and is logged in that step's report."""

    def __init__(self, step: int, log: RequestLog) -> None:
        self.step = step
        self.log = log
        self.generated: Counter[str] = Counter()
        """Tokens the engines answered each running session with so far (by session id): a step's books
        balance with what its sessions land, discard and carry on (``tokens_in_flight``)."""
        self.oldest: dict[str, int] = {}
        """The oldest weight version each running session's answers hold so far."""

    def answered(self, session_id: str, result: Result) -> None:
        """A request of the session was answered: count its tokens and its weights."""
        self.generated[session_id] += len(result.output_token_ids)
        oldest = min(result.weight_versions or [result.weight_version])
        self.oldest[session_id] = min(oldest, self.oldest.get(session_id, oldest))

    def forget(self, session_id: str) -> int:
        """The session landed or was dropped: its tokens so far."""
        self.oldest.pop(session_id, None)
        return self.generated.pop(session_id, 0)
