"""What the router learns of each replica's speed from its heartbeats.

Between two heartbeats a replica reports how many tokens its engine generated in all and how many
requests it runs. Their quotient over the interval is its decode rate (tokens/s, all requests), and
that rate over the requests running is what one request gets there (tokens/s per running request):
the figure that says where a long request would finish soonest. Both are smoothed (an exponential
moving average over intervals with requests running); an idle interval teaches nothing and an engine
restart (its counter going back) restarts the count.

It also keeps what one running request has generated there since the replica started (the sum of
every interval's tokens over the requests running in it), at each heartbeat. A request's own tokens
are that sum now minus its value at the request's dispatch, both read off that history (linear
within an interval, carried on at the last rate after the last heartbeat, or at the smoothed rate
when the last interval was idle): the router's estimate of
how long a request has run, for the ``age`` tail policy, without a message per token.
"""

from __future__ import annotations

import bisect

HISTORY = 8192
"""Heartbeats of history kept (about an hour at 0.5 s): a request older than that is counted from it."""

ALPHA = 0.3
"""Weight of the newest interval: about the last five heartbeats with work count."""


class SpeedMeter:
    __slots__ = ("tokens_per_s", "request_tokens_per_s", "peak_tokens_per_s", "peak_request_tokens_per_s",
                 "per_request_total", "_carry", "_at", "_generated", "_running", "_times", "_totals")

    def __init__(self) -> None:
        self.tokens_per_s = 0.0
        """Smoothed decode rate of the whole replica (0 until an interval with work was seen)."""
        self.request_tokens_per_s = 0.0
        """Smoothed rate one running request gets."""
        self.peak_tokens_per_s = 0.0
        """The highest smoothed decode rate seen: what the replica can do when it is full."""
        self.peak_request_tokens_per_s = 0.0
        """The highest smoothed per-request rate seen: about what one request gets alone there."""
        self.per_request_total = 0.0
        """Tokens one request running since the replica started would have (up to the last heartbeat)."""
        self._carry = 0.0
        """Per-request rate to go on at after the last heartbeat."""
        self._at: float | None = None
        self._generated = 0
        self._running = 0
        self._times: list[float] = []
        self._totals: list[float] = []

    def update(self, now: float, generated: int, running: int) -> None:
        """A heartbeat at ``now`` (monotonic seconds): ``generated`` tokens since the engine started,
        ``running`` requests in it."""
        if self._at is not None and now <= self._at:
            return
        # After an idle interval (between steps) a request dispatched since still runs: go on at the
        # rate learned before. An interval with requests running throughout and nothing produced (an
        # in-place weight update, a stalled engine) goes on at nothing; after a restart (the counter
        # went back) nothing is known either.
        restarted = self._at is not None and generated < self._generated
        stalled = self._running > 0 and running > 0
        self._carry = 0.0 if restarted or stalled else self.request_tokens_per_s
        if self._at is not None and not restarted:
            busy = (self._running + running) / 2  # running at the interval's start and its end
            produced = generated - self._generated
            if busy > 0 and produced > 0:
                rate = produced / (now - self._at)
                # At least one request ran whenever a token came out: a per-request rate is never
                # above the replica's (so a half-idle interval does not overstate it).
                busy = max(1.0, busy)
                self.tokens_per_s = rate if not self.tokens_per_s else ALPHA * rate + (1 - ALPHA) * self.tokens_per_s
                per = rate / busy
                self.per_request_total += produced / busy
                # An interval that began idle (a step starting) counts its requests as running half of
                # it, though they may have started near its end: going on from it, do not assume
                # less than the rate learned before.
                self._carry = max(per, self.request_tokens_per_s) if not self._running else per
                self.request_tokens_per_s = (per if not self.request_tokens_per_s
                                             else ALPHA * per + (1 - ALPHA) * self.request_tokens_per_s)
                self.peak_tokens_per_s = max(self.peak_tokens_per_s, self.tokens_per_s)
                self.peak_request_tokens_per_s = max(self.peak_request_tokens_per_s, self.request_tokens_per_s)
        self._at, self._generated, self._running = now, generated, running
        self._times.append(now)
        self._totals.append(self.per_request_total)
        if len(self._times) > HISTORY:
            del self._times[: HISTORY // 8], self._totals[: HISTORY // 8]

    def per_request_at(self, t: float) -> float:
        """:attr:`per_request_total` at monotonic time ``t``: linear between the heartbeats around it,
        carried on after the last one (at its rate, or at the learned rate if it was idle)."""
        times = self._times
        if not times or t <= times[0]:
            return self._totals[0] if times else 0.0
        if t >= times[-1]:
            return self.per_request_total + (t - times[-1]) * self._carry
        i = bisect.bisect_right(times, t)
        t0, t1 = times[i - 1], times[i]
        v0, v1 = self._totals[i - 1], self._totals[i]
        return v0 + (v1 - v0) * (t - t0) / (t1 - t0)

    def tokens_since(self, t: float, now: float) -> float:
        """What one request running here from monotonic time ``t`` to ``now`` has generated (estimate)."""
        return self.tokens_until(t, self.per_request_at(now))

    def tokens_until(self, t: float, total: float) -> float:
        """:meth:`tokens_since` with ``per_request_at(now)`` already read (``total``): for many requests at once."""
        return max(0.0, total - self.per_request_at(t))
