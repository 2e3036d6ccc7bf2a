"""The log of a rank's generation requests: one row per request, gathered to rank 0 as flat columns;
and the rank's open step, which a session that outlives the step it started in reads at each request."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from toolkit.core.protocol import STATUSES, Result, Route
from toolkit.session.columns import Columns


class RequestLog:
    """One row per generation request of this rank's sessions (gathered as flat arrays)."""

    def __init__(self, observe: Callable[[Result, float], None] | None = None) -> None:
        self.rows: list[tuple[float, float, float, float, str, int, int, int, int, int, int]] = []
        self.sessions_done_at: list[float] = []
        self.observe = observe
        """Called with each Result and its latency (the rank's metrics)."""

    def add(self, res: Result, route: Route | None, prompt_len: int, sent_at: float, done_at: float,
            session: int) -> None:
        """One request of session ``session`` (its index in the step) sent at ``sent_at``."""
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
        ))

    def columns(self, group_names: list[str]) -> Columns:
        rows = self.rows
        code = {g: i for i, g in enumerate(group_names)}
        return {
            "latency_s": np.array([r[0] for r in rows], dtype=np.float64),
            "done_at": np.array([r[1] for r in rows], dtype=np.float64),
            "queue_s": np.array([r[2] for r in rows], dtype=np.float64),
            "dispatched_at": np.array([r[3] for r in rows], dtype=np.float64),
            "group": np.array([code.get(r[4], -1) for r in rows], dtype=np.int16),
            "status": np.array([r[5] for r in rows], dtype=np.int8),
            "prompt_tokens": np.array([r[6] for r in rows], dtype=np.int64),
            "cached_tokens": np.array([r[7] for r in rows], dtype=np.int64),
            "output_tokens": np.array([r[8] for r in rows], dtype=np.int64),
            "session": np.array([r[9] for r in rows], dtype=np.int64),
            "moves": np.array([r[10] for r in rows], dtype=np.int64),
            # Its own length (one per session), gathered like the rest.
            "session_done_at": np.array(self.sessions_done_at, dtype=np.float64),
        }


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
