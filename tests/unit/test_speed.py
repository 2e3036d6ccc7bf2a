"""SpeedMeter: a replica's decode rate and the rate one running request gets, from heartbeats."""

from __future__ import annotations

import pytest

from toolkit.router.speed import ALPHA, SpeedMeter


def test_rates_come_from_the_intervals_with_work_smoothed() -> None:
    m = SpeedMeter()
    m.update(0.0, 0, 0)
    m.update(1.0, 0, 0)  # idle: nothing learned
    assert (m.tokens_per_s, m.request_tokens_per_s) == (0.0, 0.0)
    m.update(2.0, 400, 4)  # 400 tokens in 1 s, 2 running on average (0 then 4)
    assert (m.tokens_per_s, m.request_tokens_per_s) == (400.0, 200.0)
    m.update(3.0, 1200, 4)  # 800 tokens/s over 4 running
    assert m.tokens_per_s == pytest.approx(ALPHA * 800 + (1 - ALPHA) * 400)
    assert m.request_tokens_per_s == pytest.approx(ALPHA * 200 + (1 - ALPHA) * 200)
    assert m.peak_tokens_per_s == m.tokens_per_s
    before = (m.tokens_per_s, m.request_tokens_per_s, m.peak_tokens_per_s)
    m.update(4.0, 50, 1)  # the engine restarted (its counter went back): a new baseline only
    assert (m.tokens_per_s, m.request_tokens_per_s, m.peak_tokens_per_s) == before
    m.update(5.0, 150, 1)
    assert m.request_tokens_per_s == pytest.approx(ALPHA * 100 + (1 - ALPHA) * 200)
    m.update(6.0, 250, 0)  # 100 tokens while 1 then 0 ran: one request got them all, not two
    assert m.request_tokens_per_s <= m.tokens_per_s
    assert m.peak_tokens_per_s == before[2]  # lower now: the peak stays
    assert m.peak_request_tokens_per_s == 200.0


def test_a_request_started_after_an_idle_interval_is_counted_at_the_learned_rate() -> None:
    """Between steps a replica idles, so the last interval's rate is 0; the requests of the next step
    still run from their dispatch on, at about the rate learned before (the ``age`` policy's clock)."""
    m = SpeedMeter()
    m.update(0.0, 0, 4)
    m.update(1.0, 400, 4)  # 100 tokens/s per request
    m.update(2.0, 400, 0)  # the step ended: idle
    m.update(3.0, 400, 0)
    assert m.tokens_since(3.2, 3.7) == pytest.approx(50.0)  # dispatched at 3.2: 0.5 s at 100/s
    # The next heartbeat saw the step start late in its interval: 80 tokens while 0 then 4 ran would
    # say 40/s per request (80/s over 2 on average); going on from it, the meter keeps the rate it knew.
    m.update(4.0, 480, 4)  # 80 tokens in the interval
    assert m.tokens_since(4.0, 4.5) == pytest.approx(50.0)
    m.update(5.0, 880, 4)  # a full interval of work: its own rate again
    assert m.tokens_since(5.0, 5.5) == pytest.approx(50.0)


def test_a_stalled_replica_ages_its_requests_no_further() -> None:
    """An interval with requests running and no token out (an in-place weight update, a stalled
    engine): the requests there are not older for it, so the ``age`` policy does not move them."""
    m = SpeedMeter()
    m.update(0.0, 0, 4)
    m.update(1.0, 400, 4)  # 100 tokens/s per request
    assert m.tokens_since(1.0, 1.5) == pytest.approx(50.0)
    m.update(2.0, 400, 4)  # four running, nothing out
    assert m.tokens_since(2.0, 3.0) == 0.0
    assert m.tokens_since(0.5, 3.0) == pytest.approx(50.0)  # what it made before the stall
    m.update(3.0, 500, 4)  # going again
    assert m.tokens_since(3.0, 3.5) > 0.0
