from __future__ import annotations

import math
import random

import pytest

from toolkit.core.errors import ConfigError
from toolkit.core.names import place, replica_id
from toolkit.router.policy import ConsistentHash, LeastLoaded, PowerOfTwo, RoundRobin, make_policy
from toolkit.router.replica import Replica


def with_room(rs: list[Replica]) -> list[Replica]:
    return [r for r in rs if r.has_room]


def replicas(n: int, cap: int = 1000) -> list[Replica]:
    return [Replica(f"r{i}", f"r{i}".encode(), "g", cap, 4096, 32000) for i in range(n)]


def test_consistent_hash_keeps_a_session_on_one_replica() -> None:
    rs = replicas(4)
    p = ConsistentHash(rs, 1.25)
    first = {f"s{i}": p.choose(f"s{i}", 0, with_room(rs)) for i in range(50)}
    assert all(p.choose(s, 0, with_room(rs)) is r for s, r in first.items())
    assert len({r.replica_id for r in first.values()}) == 4  # sessions spread over replicas


def test_consistent_hash_bounded_load_never_exceeds_bound() -> None:
    rs = replicas(5)
    p = ConsistentHash(rs, 1.25)
    rng = random.Random(0)
    total = 0
    hot = [f"hot{i}" for i in range(3)]
    for k in range(2000):
        # Skewed keys: plain consistent hashing would pile these onto one or two replicas.
        sid = rng.choice(hot) if rng.random() < 0.8 else f"s{k}"
        bound = math.ceil(1.25 * (total + 1) / len(rs))
        r = p.choose(sid, total, with_room(rs))
        assert r is not None
        r.inflight[f"q{k}"] = None
        total += 1
        assert max(x.load for x in rs) <= bound


def test_bounded_load_is_in_proportion_to_replica_size() -> None:
    # A 64-slot and a 16-slot replica: with 128 sessions in flight both must fill up, not stop at
    # a bound computed as if they were the same size.
    big, small = (Replica("big", b"big", "g", 64, 4096, 32000), Replica("small", b"small", "g", 16, 4096, 32000))
    rs = [big, small]
    p = ConsistentHash(rs, 1.25)
    for k in range(80):
        r = p.choose(f"s{k}", k, with_room(rs))
        assert r is not None, k
        r.inflight[f"q{k}"] = None
    assert big.load == 64 and small.load == 16


def test_consistent_hash_moves_few_sessions_when_a_replica_joins() -> None:
    rs = replicas(4)
    p = ConsistentHash(rs, 100.0)
    before = {f"s{i}": p.choose(f"s{i}", 0, with_room(rs)).replica_id for i in range(400)}
    rs2 = rs + replicas(5)[4:]
    p.update(rs2)
    after = {s: p.choose(s, 0, with_room(rs2)).replica_id for s in before}
    moved = sum(before[s] != after[s] for s in before)
    assert 0 < moved < 400 * 0.35  # about 1/5 should move
    fresh = ConsistentHash(rs2, 100.0)  # the sessions' places were found again on the new ring
    assert after == {s: fresh.choose(s, 0, with_room(rs2)).replica_id for s in before}


def test_least_loaded_and_full_replicas() -> None:
    rs = replicas(3, cap=2)
    p = LeastLoaded(rs)
    rs[0].inflight = {"a": None}
    assert p.choose("x", 1, with_room(rs)) is rs[1]
    for r in rs:
        r.inflight = {"a": None, "b": None}
    assert p.choose("x", 6, with_room(rs)) is None


def test_round_robin_cycles_and_skips_full() -> None:
    rs = replicas(3, cap=1)
    p = RoundRobin(rs)
    picks = [p.choose("x", 0, with_room(rs)) for _ in range(3)]
    assert [r.replica_id for r in picks] == ["r0", "r1", "r2"]
    rs[0].inflight = {"a": None}
    assert p.choose("x", 1, with_room(rs)) is rs[1]


def test_power_of_two_prefers_less_loaded_and_finds_free() -> None:
    rs = replicas(6, cap=1)
    p = PowerOfTwo(rs, seed=1)
    for r in rs[:5]:
        r.inflight = {"a": None}
    assert p.choose("x", 5, with_room(rs)) is rs[5]


def test_consistent_hash_when_nearly_saturated_takes_a_free_replica() -> None:
    rs = replicas(64, cap=2)
    p = ConsistentHash(rs, 1.25)
    for r in rs:
        r.inflight = {"a": None, "b": None}
    rs[17].inflight = {"a": None}
    assert p.choose("any-session", 127, with_room(rs)) is rs[17]


@pytest.mark.parametrize("n", [3, 64])  # the ring walk, and the nearly saturated shortcut
def test_with_affinity_wait_a_session_waits_for_its_own_full_replica(n: int) -> None:
    rs = replicas(n, cap=2)
    spill, wait = ConsistentHash(rs, 1.25), ConsistentHash(rs, 1.25, wait_for_home=True)
    home = wait.choose("s", 0, with_room(rs))
    assert home is not None and spill.choose("s", 0, with_room(rs)) is home  # the same home either way
    other = next(r for r in rs if r is not home)
    for r in rs:  # a saturated fleet: every replica full but one, and the session's own
        r.inflight = {"a": None, "b": None} if r is not other else {"a": None}
    load = 2 * n - 1
    assert spill.choose("s", load, with_room(rs)) is other  # it computes its context there again
    assert wait.choose("s", load, with_room(rs)) is None  # it waits for a slot at home
    home.inflight = {"a": None}
    assert wait.choose("s", load - 1, with_room(rs)) is home
    assert make_policy("consistent_hash", rs, affinity="wait").choose("s", load - 1, with_room(rs)) is home


def test_unknown_policy_names_the_options() -> None:
    with pytest.raises(ConfigError, match="least_loaded"):
        make_policy("random", replicas(1))


def test_a_fleet_registering_one_by_one_builds_the_ring_once_and_as_a_fresh_one_would(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each registration changes the group; the ring is rebuilt at the next choice only (hashing every
    replica's points at every registration made a 512-replica fleet's start quadratic)."""
    rs = replicas(160)  # past RING_POINTS / VNODES (128): VNODES points each, whatever the fleet's size
    p = ConsistentHash(rs[:1], 1.25)
    builds = []
    real = ConsistentHash._rebuild
    monkeypatch.setattr(ConsistentHash, "_rebuild", lambda self: (builds.append(self), real(self)))
    for n in range(2, len(rs) + 1):
        p.update(rs[:n])
    sessions = [f"s{i}" for i in range(200)]
    got = [p.choose(s, 0, with_room(rs)) for s in sessions]
    assert builds == [p]
    fresh = ConsistentHash(rs, 1.25)
    assert got == [fresh.choose(s, 0, with_room(rs)) for s in sessions]
    # A replica that leaves takes its points with it; the others keep their sessions.
    p.update(rs[1:])
    moved = [s for s, r in zip(sessions, got, strict=True) if r is not rs[0] and p.choose(s, 0, with_room(rs[1:])) is not r]
    assert moved == [] and [b for b in builds if b is p] == [p, p]


def test_a_small_fleet_shares_sessions_evenly_and_a_leave_moves_few_of_the_others() -> None:
    """Under 128 replicas each takes more points (RING_POINTS in all), so that its share is even; as the
    fleet changes size each takes a few more or fewer, and a few of the others' sessions move too."""
    for n in (2, 3, 4):
        rs = [Replica(f"throughput-{i}@h:{i}", f"t{i}".encode(), "g", 10**6, 4096, 32000) for i in range(n)]
        p = ConsistentHash(rs, 100.0)
        homes = [p.choose(f"rollout/0/{k}", 0, rs) for k in range(8000)]
        assert all(abs(homes.count(r) / len(homes) - 1 / n) < 0.03 for r in rs)  # 64 points each: 0.13 off
    rs = replicas(64)
    p = ConsistentHash(rs, 1.25)
    sessions = [f"s{i}" for i in range(2000)]
    got = [p.choose(s, 0, with_room(rs)) for s in sessions]
    p.update(rs[1:])
    moved = [s for s, r in zip(sessions, got, strict=True) if r is not rs[0] and p.choose(s, 0, with_room(rs[1:])) is not r]
    assert len(moved) < 0.05 * len(sessions)


def test_the_load_bound_follows_the_group_capacity_as_replicas_join() -> None:
    """The capacity is summed at the next bound after a change, not at each join: still exact."""
    rs = replicas(2, cap=10)
    p = ConsistentHash(rs, 1.0)
    assert p.bound(rs[0], 9) == 5  # 10 in flight x 10 / 20 slots
    big = Replica("big", b"big", "g", 80, 4096, 32000)
    p.update([*rs, big])
    assert (p.bound(rs[0], 9), p.bound(big, 9)) == (1, 8)  # 10 x 10 / 100, 10 x 80 / 100
    p.update(rs)
    assert p.bound(rs[0], 9) == 5


def test_consistent_hash_places_replicas_by_their_place_in_the_fleet_not_their_pid() -> None:
    # Two runs of one fleet (other hosts and pids), a replica restarted, and the twin's: one ring.
    def fleet(suffix: str) -> list[Replica]:
        rs = [Replica(replica_id("g", i, f"{suffix}{i}"), f"g-{i}".encode(), "g", 1000, 4096, 32000) for i in range(3)]
        assert [r.place for r in rs] == [place("g", i) for i in range(3)]
        return rs

    homes = []
    for suffix in ("node1:41", "node7:9", "twin"):
        rs = fleet(suffix)
        p = ConsistentHash(rs, 1.25)
        homes.append([rs.index(p.choose(f"s{k}", 0, with_room(rs))) for k in range(200)])  # type: ignore[arg-type]
    assert homes[0] == homes[1] == homes[2]
    assert len(set(homes[0])) == 3
