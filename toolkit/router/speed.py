"""What the router learns of each replica's speed from its heartbeats.

Between two heartbeats a replica reports how many tokens its engine generated in all and how many
requests it runs. Their quotient over the interval is its decode rate (tokens/s, all requests), and
that rate over the requests running is what one request gets there (tokens/s per running request):
the figure that says where a long request would finish soonest. Both are smoothed (an exponential
moving average over intervals with requests running); an idle interval teaches nothing and an engine
restart (its counter going back) restarts the count.

It also keeps what one running request has generated there since the replica started (the sum of
every interval's tokens over the requests running in it). A request's own tokens are that sum now
minus its value at the request's dispatch: the router's estimate of how long a request has run, for
the ``age`` tail policy, without a message per token. Between heartbeats it runs on at the last rate.
"""

from __future__ import annotations

ALPHA = 0.3
"""Weight of the newest interval: about the last five heartbeats with work count."""


class SpeedMeter:
    __slots__ = ("tokens_per_s", "request_tokens_per_s", "peak_tokens_per_s", "peak_request_tokens_per_s",
                 "per_request_total", "_per_request_rate", "_at", "_generated", "_running")

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
        self._per_request_rate = 0.0
        self._at: float | None = None
        self._generated = 0
        self._running = 0

    def update(self, now: float, generated: int, running: int) -> None:
        """A heartbeat at ``now`` (monotonic seconds): ``generated`` tokens since the engine started,
        ``running`` requests in it."""
        if self._at is not None and generated >= self._generated and now > self._at:
            busy = (self._running + running) / 2  # running at the interval's start and its end
            produced = generated - self._generated
            self._per_request_rate = 0.0
            if busy > 0 and produced > 0:
                rate = produced / (now - self._at)
                # At least one request ran whenever a token came out: a per-request rate is never
                # above the replica's (so a half-idle interval does not overstate it).
                busy = max(1.0, busy)
                self.tokens_per_s = rate if not self.tokens_per_s else ALPHA * rate + (1 - ALPHA) * self.tokens_per_s
                per = rate / busy
                self.per_request_total += produced / busy
                self._per_request_rate = per
                self.request_tokens_per_s = (per if not self.request_tokens_per_s
                                             else ALPHA * per + (1 - ALPHA) * self.request_tokens_per_s)
                self.peak_tokens_per_s = max(self.peak_tokens_per_s, self.tokens_per_s)
                self.peak_request_tokens_per_s = max(self.peak_request_tokens_per_s, self.request_tokens_per_s)
        self._at, self._generated, self._running = now, generated, running

    def per_request_at(self, now: float) -> float:
        """:attr:`per_request_total` carried on to ``now`` at the last interval's rate (a request's
        tokens are this at ``now`` minus this at its dispatch)."""
        if self._at is None or now <= self._at:
            return self.per_request_total
        return self.per_request_total + (now - self._at) * self._per_request_rate
