from __future__ import annotations

from toolkit.core.protocol import Generate
from toolkit.router.queue import FairQueue, Request

_seq = 0


def req(job: str, name: str, group: str | None = None) -> Request:
    global _seq
    _seq += 1
    return Request(Generate(name, job=job, group=group), b"", b"c", job, _seq, 0.0)


def drain(q: FairQueue, can=lambda r: True) -> list[str]:  # type: ignore[no-untyped-def]
    out = []
    while True:
        got = [r.request_id for r, _ in q.pop_round(lambda r: "here" if can(r) else None)]
        if not got:
            return out
        out.extend(got)


def test_one_per_job_in_turn_oldest_first() -> None:
    q = FairQueue()
    for i in range(5):
        q.push(req("A", f"a{i}"))
    for i in range(2):
        q.push(req("B", f"b{i}"))
    # B arrived later but was never served: it goes first; then turns alternate.
    assert drain(q) == ["b0", "a0", "b1", "a1", "a2", "a3", "a4"]
    assert q.size == 0


def test_job_served_longest_ago_starts() -> None:
    q = FairQueue()
    q.push(req("A", "a0"))
    q.push(req("B", "b0"))
    assert drain(q) == ["b0", "a0"]
    # A was served last; B longer ago. Both submit again: B first.
    q.push(req("A", "a1"))
    q.push(req("B", "b1"))
    assert drain(q) == ["b1", "a1"]


def test_requeued_requests_go_to_front_in_original_order() -> None:
    q = FairQueue()
    rs = [req("A", f"a{i}") for i in range(4)]
    for r in rs[2:]:
        q.push(r)
    q.requeue_front([rs[1], rs[0]])
    assert drain(q) == ["a0", "a1", "a2", "a3"]


def test_discard_and_group_buckets_do_not_block() -> None:
    q = FairQueue()
    a0 = req("A", "a0", group="tail")
    q.push(a0)
    q.push(req("A", "a1", group="throughput"))
    q.push(req("A", "a2", group="tail"))
    # The tail group is full: the throughput request still goes.
    assert drain(q, lambda r: r.msg.group != "tail") == ["a1"]
    q.discard(a0)
    assert q.size == 1
    assert drain(q) == ["a2"]


def test_the_place_comes_with_the_request_it_was_chosen_for() -> None:
    # A younger head gets a place, then an older head in another bucket finds none: the younger
    # one is returned with its own place (the router once kept only the last choice and crashed).
    q = FairQueue()
    old = req("A", "old", group="tail")
    young = req("A", "young")
    q.push(young)  # its bucket is looked at first; the older head's bucket after it
    q.push(old)
    places = {"young": "replica-1", "old": None}
    got = list(q.pop_round(lambda r: places[r.request_id]))
    assert [(r.request_id, place) for r, place in got] == [("young", "replica-1")]
    assert q.size == 1


def test_with_a_scan_a_head_that_must_wait_does_not_hold_up_the_requests_behind_it() -> None:
    for scan, want in ((1, []), (2, ["a1", "a2", "a3"])):
        q = FairQueue(scan)
        for i in range(4):
            q.push(req("A", f"a{i}"))
        # a0 waits (its replica is full): with a scan, those behind it go meanwhile, oldest first.
        assert drain(q, lambda r: r.request_id != "a0") == want
        assert q.size == 4 - len(want)
    assert drain(q) == ["a0"]  # once it has a place
