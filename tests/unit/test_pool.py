"""ReplicaPool: who serves which group, and the slot counts a dispatch decision reads."""

from __future__ import annotations

from toolkit.config import compose_config
from toolkit.core.protocol import Generate, ReplicaStats
from toolkit.router.pool import ReplicaPool, limit_error
from toolkit.router.queue import Request
from toolkit.router.replica import Replica


def pool() -> ReplicaPool:
    cfg = compose_config(["router.policy=round_robin", "router.suspects_per_replica=1"])
    return ReplicaPool(cfg.router, seed=0)


def replica(n: int, group: str, max_inflight: int = 2, max_model_len: int = 100, vocab: int = 50) -> Replica:
    return Replica(f"{group}-{n}@h:{n}", f"id{n}".encode(), group, max_inflight, max_model_len, vocab)


def request(rid: str, deaths: int = 0) -> Request:
    req = Request(Generate(rid, prompt_token_ids=[1, 2, 3]), b"", b"client", "j", 0, 0.0)
    req.deaths = ("r0: test",) * deaths
    return req


def test_a_replica_serves_only_once_ready_and_every_count_follows_it() -> None:
    p = pool()
    a, b = replica(0, "throughput"), replica(1, "tail", max_inflight=3, max_model_len=40, vocab=30)
    p.add(a)
    p.add(b)
    assert p.get(a.replica_id) is a and p.choose(None, "s") is None  # registered, not probed yet
    p.set_ready(a)
    p.set_ready(b)
    assert (p.capacity(None), p.spare_slots(None), p.capacity("tail")) == (5, 5, 3)
    assert [p.limits(g) for g in (None, "throughput", "tail")] == [(40, 30), (100, 50), (40, 30)]
    assert p.choose("tail", "s") is b and p.choose("nope", "s") is None
    held = [request(f"r{i}") for i in range(3)]
    for req in held:
        p.take_slot(b, req)
    assert set(b.inflight) == {"r0", "r1", "r2"} and b.load == 3
    assert p.spare_slots("tail") == 0 and p.choose("tail", "s") is None and p.choose(None, "s") is a
    p.set_draining(b)  # out of every count though it still holds requests
    assert b.draining and b.load == 3
    assert (p.capacity(None), p.spare_slots(None), p.members("tail"), p.limits("tail")) == (2, 2, [], None)
    assert p.release_slot(b, held[0])  # a drained replica's released slot is not offered
    assert not p.release_slot(b, held[0])  # released once
    assert p.spare_slots(None) == 2 and b not in p.with_room(None)
    p.remove(a)
    assert p.get(a.replica_id) is None and p.capacity(None) == 0 and p.spare_slots(None) == 0
    assert not p.with_room(None)


def test_a_suspect_goes_to_the_least_loaded_replica_without_one() -> None:
    p = pool()
    a, b = replica(0, "throughput", max_inflight=4), replica(1, "throughput", max_inflight=4)
    for r in (a, b):
        p.add(r)
        p.set_ready(r)
    p.take_slot(a, request("dead", deaths=1))
    p.take_slot(b, request("x"))
    p.take_slot(b, request("y"))
    assert (a.suspects, b.suspects) == (1, 0)
    assert p.choose_for_suspect("throughput") is b  # a holds a suspect already (cap 1), b is busier
    p.take_slot(b, request("z", deaths=1))
    assert p.choose_for_suspect("throughput") is None


def test_a_replica_whose_engine_died_leaves_dispatch_and_comes_back_with_its_slots() -> None:
    # The router's engine_died: set_unready; its requests finish meanwhile; a new probe (set_ready)
    # offers exactly its spare slots again.
    p = pool()
    a, b = replica(0, "throughput", max_inflight=3), replica(1, "throughput", max_inflight=3)
    for r in (a, b):
        p.add(r)
        p.set_ready(r)
    r1, r2 = request("r1"), request("r2")
    p.take_slot(a, r1)
    p.take_slot(a, r2)
    assert p.spare_slots("throughput") == 4
    p.set_unready(a)
    assert not a.ready
    assert (p.capacity("throughput"), p.spare_slots("throughput"), p.members("throughput")) == (3, 3, [b])
    assert p.release_slot(a, r1)  # an answer from the dead engine releases nothing that is offered
    assert p.spare_slots("throughput") == 3 and a not in p.with_room("throughput")
    assert all(p.choose("throughput", f"s{i}") is b for i in range(5))
    p.set_ready(a)  # its probe passed: back with max_inflight - load spare slots
    assert (p.capacity("throughput"), p.spare_slots("throughput")) == (6, 5) and a in p.with_room("throughput")


def test_a_dropped_replica_hands_back_what_it_held() -> None:
    p = pool()
    a = replica(0, "throughput", max_inflight=3)
    p.add(a)
    p.set_ready(a)
    held = [request("r1"), request("r2")]
    for req in held:
        p.take_slot(a, req)
    assert p.remove(a) == held and not a.inflight
    assert p.known(a.identity) is None and p.spare_slots(None) == 0 and p.capacity("throughput") == 0


def test_a_group_sums_its_replicas_engine_counters_and_skips_a_restart() -> None:
    p = pool()
    a, b = replica(0, "throughput"), replica(1, "throughput")
    for r in (a, b):
        p.add(r)
        p.set_ready(r)
    zero = ReplicaStats()
    p.count_generated(a, zero, ReplicaStats(generated_tokens=10, engine_steps=5, prefill_tokens=100,
                                            model_s=0.5, active_s=0.6), 1.0)
    p.count_generated(b, zero, ReplicaStats(generated_tokens=0, engine_steps=0), 1.0)
    # An engine that restarted reports smaller counters: nothing negative is counted.
    p.count_generated(a, ReplicaStats(generated_tokens=10, engine_steps=5, model_s=0.5),
                      ReplicaStats(generated_tokens=3, engine_steps=2, model_s=0.2, active_s=0.9), 1.0)
    g = p.group_status(["throughput"], lambda r: False)["throughput"]
    assert (g.generated_tokens, g.engine_steps, g.prefill_tokens) == (10, 5, 100)
    assert (g.model_s, g.active_s, g.replica_s, g.busy_s) == (0.5, 0.6 + 0.9, 3.0, 1.0)


def test_the_limits_follow_replicas_that_join_and_leave_one_by_one() -> None:
    """A join takes its limits in without a pass over the others; a leave recomputes them."""
    p = pool()
    rs = [replica(i, "throughput", max_model_len=m, vocab=v) for i, (m, v) in enumerate([(100, 50), (60, 70), (80, 40)])]
    seen = []
    for r in rs:
        p.add(r)
        p.set_ready(r)
        seen.append(p.limits("throughput"))
    assert seen == [(100, 50), (60, 50), (60, 40)]
    p.set_unready(rs[1])  # the shortest context leaves
    assert p.limits("throughput") == p.limits(None) == (80, 40)
    p.set_draining(rs[2])
    assert p.limits("throughput") == (100, 50)
    p.set_ready(rs[1])  # back
    assert p.limits("throughput") == (60, 50)


def test_a_prompts_token_ids_are_checked_once_per_smaller_vocabulary() -> None:
    """``limit_error`` names the id outside the vocabulary, and checks a prompt's ids again only for a
    replica whose vocabulary is smaller than the one they passed."""
    def req(ids: list[int]) -> Request:
        return Request(Generate("r", prompt_token_ids=ids), b"", b"client", "j", 0, 0.0)

    ok = req([0, 7, 49])
    assert limit_error(ok, 100, 50) == "" and ok.ids_below == 50
    assert limit_error(ok, 100, 80) == "" and ok.ids_below == 50  # a larger vocabulary: no second look
    assert limit_error(ok, 100, 49) == "token id 49 outside the vocabulary [0, 49)"
    assert ok.ids_below == 50
    small = req([3, 4])
    assert limit_error(small, 100, 50) == "" and limit_error(small, 100, 5) == "" and small.ids_below == 5
    assert limit_error(req([5, -2, 60]), 100, 50) == "token id -2 outside the vocabulary [0, 50)"
    high = req([5, 60, 2])
    assert limit_error(high, 100, 50) == "token id 60 outside the vocabulary [0, 50)" and high.ids_below == 0
    assert limit_error(req([1] * 100), 100, 50) == "prompt of 100 tokens leaves no room for an output token in max_model_len 100"
