"""The router's deadlines (``toolkit/router/deadlines.py``): the live requests past theirs, in the order
they went live, none answered, and a heap that stays bounded by the live ones."""

from __future__ import annotations

from toolkit.core.protocol import Generate
from toolkit.router.deadlines import Deadlines
from toolkit.router.queue import Request


def test_due_are_the_live_requests_past_their_deadline_in_the_order_they_went_live() -> None:
    live: dict = {}
    d = Deadlines(live)
    for seq, deadline in enumerate([50.0, 10.0, 30.0, 20.0, 90.0], start=1):
        q = Request(Generate(f"r{seq}", deadline=deadline), b"", b"c", "j", seq, 0.0)
        live[q.request_id] = q
        d.add(q)
    del live["r4"]  # answered before its deadline
    d.done()
    assert len(d) == 4
    assert [q.request_id for q in d.due(35.0)] == ["r2", "r3"]  # r4 (20.0) is no longer live
    assert d.due(35.0) == []
    live["r1"] = Request(Generate("r1", deadline=60.0), b"", b"c", "j", 9, 0.0)  # the same id, submitted again
    d.add(live["r1"])
    assert [q.seq for q in d.due(55.0)] == []  # the old r1 entry (50.0) is not the live r1
    assert [q.seq for q in d.due(70.0)] == [9]


def test_answered_requests_do_not_pile_up() -> None:
    live: dict = {}
    d = Deadlines(live)
    for seq in range(1, 10_001):
        q = Request(Generate(f"r{seq}", deadline=1e9), b"", b"c", "j", seq, 0.0)
        live[q.request_id] = q
        d.add(q)
        if seq > 10:  # ten stay live, the rest are answered at once
            del live[q.request_id]
            d.done()
    assert len(d) == 10 and len(d._heap) <= 2 * 10 + 64
    assert [q.seq for q in d.due(2e9)] == list(range(1, 11))
