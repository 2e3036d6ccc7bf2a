"""ReplicaPool: who serves which group, and the slot counts a dispatch decision reads."""

from __future__ import annotations

from toolkit.config import compose_config
from toolkit.router.policy import Replica
from toolkit.router.pool import ReplicaPool


def pool() -> ReplicaPool:
    cfg = compose_config(["router.policy=round_robin", "router.suspects_per_replica=1"])
    return ReplicaPool(cfg.router, seed=0)


def replica(n: int, group: str, max_inflight: int = 2, max_model_len: int = 100, vocab: int = 50) -> Replica:
    return Replica(f"{group}-{n}@h:{n}", f"id{n}".encode(), group, max_inflight, max_model_len, vocab)


def test_a_replica_serves_only_once_ready_and_every_count_follows_it() -> None:
    p = pool()
    a, b = replica(0, "throughput"), replica(1, "tail", max_inflight=3, max_model_len=40, vocab=30)
    p.add(a)
    p.add(b)
    assert p.get(a.replica_id) is a and p.choose(None, "s") is None  # registered, not probed yet
    p.set_ready(a)
    p.set_ready(b)
    assert (p.capacity[None], p.free[None], p.capacity["tail"]) == (5, 5, 3)
    assert p.limits == {None: (40, 30), "throughput": (100, 50), "tail": (40, 30)}
    assert p.choose("tail", "s") is b and p.choose("nope", "s") is None
    p.take_slot(b, -3)
    b.inflight.update({"r1": None, "r2": None, "r3": None})
    assert p.free["tail"] == 0 and p.choose("tail", "s") is None and p.choose(None, "s") is a
    p.withdraw(b)  # draining: out of every count though it still holds requests
    b.draining = True
    assert (p.capacity[None], p.free[None], p.groups["tail"], p.limits.get("tail")) == (2, 2, [], None)
    p.take_slot(b, +1)  # a drained replica's freed slot is not offered
    assert p.free[None] == 2 and b not in p.free_sets[None]
    p.remove(a)
    assert p.get(a.replica_id) is None and p.capacity[None] == 0 and p.free[None] == 0 and not p.free_sets[None]


def test_a_suspect_goes_to_the_least_loaded_replica_without_one() -> None:
    p = pool()
    a, b = replica(0, "throughput", max_inflight=4), replica(1, "throughput", max_inflight=4)
    for r in (a, b):
        p.add(r)
        p.set_ready(r)
    a.suspects = 1
    b.inflight.update({"x": None})
    p.take_slot(b, -1)
    assert p.choose_for_suspect("throughput") is b  # a holds a suspect already (cap 1), b is busier
    b.suspects = 1
    assert p.choose_for_suspect("throughput") is None


def test_a_replica_whose_engine_died_leaves_dispatch_and_comes_back_with_its_slots() -> None:
    # The router's engine_died: withdraw and un-ready it; its requests finish meanwhile; a new probe
    # (set_ready) offers exactly its free slots again.
    p = pool()
    a, b = replica(0, "throughput", max_inflight=3), replica(1, "throughput", max_inflight=3)
    for r in (a, b):
        p.add(r)
        p.set_ready(r)
    for rid in ("r1", "r2"):
        a.inflight[rid] = None
        p.take_slot(a, -1)
    assert p.free["throughput"] == 4
    p.withdraw(a)
    a.ready = False
    assert (p.capacity["throughput"], p.free["throughput"], p.groups["throughput"]) == (3, 3, [b])
    del a.inflight["r1"]
    p.take_slot(a, +1)  # an answer from the dead engine frees nothing that is offered
    assert p.free["throughput"] == 3 and a not in p.free_sets["throughput"]
    assert all(p.choose("throughput", f"s{i}") is b for i in range(5))
    p.set_ready(a)  # its probe passed: back with max_inflight - load free slots
    assert (p.capacity["throughput"], p.free["throughput"]) == (6, 5) and a in p.free_sets["throughput"]
