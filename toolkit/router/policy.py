"""Replica choice within one group. Chosen by ``router.policy``; each policy is one class.

Every policy is handed the group's replicas with room (a slot not taken: ``inflight < max_inflight``) and
returns one of them, or None when the group is full. They keep O(replicas) work per decision at most.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable

from toolkit.config import Affinity, RouterPolicyName
from toolkit.core.errors import ConfigError, FieldError
from toolkit.router.kv_index import WAIT, KvIndex
from toolkit.router.queue import Request
from toolkit.router.replica import Replica


def _hash64(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class Policy(ABC):
    def __init__(self, replicas: list[Replica]) -> None:
        self.replicas = replicas

    def update(self, replicas: list[Replica]) -> None:
        """The group's ready replicas changed."""
        self.replicas = replicas

    def reweight(self) -> None:  # noqa: B027 (a hook: only speed-aware policies override it)
        """A step boundary: take in what was learned of the replicas' speeds (if the policy uses them)."""

    @abstractmethod
    def choose(self, session_id: str, group_load: int, with_room: Collection[Replica],
               req: Request | None = None) -> Replica | None:
        """Pick a replica with room. ``group_load`` is the group's total in-flight count; ``with_room``
        holds exactly the group's replicas that have a slot not taken (kept by the pool); ``req``: the
        request (its prompt, for a policy that reads it)."""


def least_loaded(with_room: Iterable[Replica], bound: int = 1 << 62) -> Replica | None:
    best = None
    best_load = bound
    for r in with_room:
        load = len(r.inflight)
        if load < best_load:
            best, best_load = r, load
    return best


class LeastLoaded(Policy):
    def choose(self, session_id: str, group_load: int, with_room: Collection[Replica],
               req: Request | None = None) -> Replica | None:
        return least_loaded(with_room)


class RoundRobin(Policy):
    def __init__(self, replicas: list[Replica]) -> None:
        super().__init__(replicas)
        self._next = 0

    def choose(self, session_id: str, group_load: int, with_room: Collection[Replica],
               req: Request | None = None) -> Replica | None:
        n = len(self.replicas)
        for i in range(n):
            r = self.replicas[(self._next + i) % n]
            if r.has_room:
                self._next = (self._next + i + 1) % n
                return r
        return None


class PowerOfTwo(Policy):
    def __init__(self, replicas: list[Replica], seed: int = 0) -> None:
        super().__init__(replicas)
        self._rng = random.Random(seed)

    def choose(self, session_id: str, group_load: int, with_room: Collection[Replica],
               req: Request | None = None) -> Replica | None:
        picks = self.replicas if len(self.replicas) <= 2 else self._rng.sample(self.replicas, 2)
        cands = [r for r in picks if r.has_room]
        if not cands:
            # Both samples were full: take the least loaded one with room, so a spare slot is never missed.
            return least_loaded(with_room)
        return min(cands, key=lambda r: len(r.inflight))


class ConsistentHash(Policy):
    """Consistent hashing on the session id with bounded loads (Mirrokni et al., 2018).

    A session maps to the first replica clockwise on a ring of virtual nodes whose load is below
    its share of ``load_factor * (group_load + 1)``, the share being its ``max_inflight`` over the
    group's total (replicas of different sizes get bounds in proportion). Sessions stay on one
    replica (prefix cache) unless that replica is overloaded, which plain consistent hashing lets
    happen.

    Each replica's share of the ring follows its speed (its peak decode rate, learned from heartbeats),
    so a faster replica is the first choice of more sessions. The ring changes only at step boundaries
    (:meth:`reweight`) and only when a speed moved by more than :data:`REWEIGHT_CHANGE`, so a
    session's turns within a step keep their replica.
    """

    VNODES = 64
    RING_POINTS = 8192
    """Points on the ring in all at least: a fleet of few replicas gets more of them each (4,096 each for
    two), so that its replicas' shares of the sessions are even. At 64 a replica, two replicas' shares
    stray from a half by 0.044 (one standard deviation of where the points fall): the default fleet's
    two throughput replicas drew 0.37 and 0.63."""
    WALK = 64
    STARTS_KEPT = 1 << 18
    """Sessions whose place on the ring is kept (all are forgotten past it: a step's are found again)."""
    REWEIGHT_CHANGE = 0.2

    def __init__(self, replicas: list[Replica], load_factor: float = 1.25, wait_for_home: bool = False) -> None:
        self.load_factor = load_factor
        self.wait_for_home = wait_for_home
        """``router.affinity=wait``: a session whose own replica is full waits for it (None), not spills."""
        self._ring: list[int] = []
        self._owners: list[Replica] = []
        self._capacity = 0
        """The replicas' slots in all (0: to be summed, at the next :meth:`bound`)."""
        self._stale = True
        self._starts: dict[str, int] = {}
        """Each session's place on the ring (the bisection of its hash) while the ring stands: a
        session's later turns neither hash again nor search a ring of VNODES x n points."""
        self._points: dict[str, list[int]] = {}
        """Each replica's ring points by place, as many as it has had (it takes the first of them it needs:
        a new weight or fleet size hashes only points it never had)."""
        self.weights: dict[str, float] = {}
        """Ring weight per replica id (mean 1 over those with a known speed; 1 for the others)."""
        super().__init__(replicas)
        self.update(replicas)

    def update(self, replicas: list[Replica]) -> None:
        # The ring is rebuilt at the next choice and the capacity summed at the next bound, not here: a
        # fleet of n replicas registering one by one would otherwise do either n times (at 512 replicas
        # the ring's rebuilds were a minute of the router's loop; at 4,096 the sums were seconds).
        self.replicas = replicas
        self._capacity = 0
        self._stale = True

    def _total(self) -> int:
        self._capacity = max(1, sum(r.max_inflight for r in self.replicas))
        return self._capacity

    def _rebuild(self) -> None:
        """The ring of the current replicas; each replica's points are hashed once."""
        points: list[tuple[int, int]] = []
        known: dict[str, list[int]] = {}
        per = max(self.VNODES, -(-self.RING_POINTS // max(1, len(self.replicas))))
        for i, r in enumerate(self.replicas):
            k = max(1, round(per * self.weights.get(r.replica_id, 1.0)))
            hashes = known.get(r.place) or self._points.get(r.place, [])
            if len(hashes) < k:
                hashes = hashes + [_hash64(f"{r.place}#{v}") for v in range(len(hashes), k)]
            known[r.place] = hashes
            points.extend((h, i) for h in hashes[:k])
        points.sort()
        self._points = known  # only the replicas of this ring: gone ones are forgotten
        self._ring = [p for p, _ in points]
        self._owners = [self.replicas[i] for _, i in points]
        self._starts.clear()
        self._stale = False

    def reweight(self) -> None:
        """Weight the ring by group: a replica's speed is the mean peak of its group's replicas with one
        known. A group's replicas run one engine config, so what tells them apart is what their first
        steps happened to be: how full each one got (identical replicas of the twin peaked 16% apart) and,
        on a busy host, its share of the CPU (74% apart on two cores). A ring weighted by that would keep
        an accident for the run (:data:`REWEIGHT_CHANGE`); groups of different speeds still get shares in
        proportion. Replicas of different speeds belong in different groups."""
        by_group: dict[str, list[float]] = {}
        for r in self.replicas:
            if r.speed.peak_tokens_per_s > 0:
                by_group.setdefault(r.group, []).append(r.speed.peak_tokens_per_s)
        means = {g: sum(v) / len(v) for g, v in by_group.items()}
        self.set_speeds({r.replica_id: means[r.group] for r in self.replicas if r.group in means})

    def set_speeds(self, speeds: dict[str, float]) -> None:
        """Weight the ring by each replica's full-batch decode rate (``speeds``, tokens/s); a change
        within ``REWEIGHT_CHANGE`` of every weight keeps the ring as it is (and the sessions' homes)."""
        if len(speeds) < 2:
            return
        mean = sum(speeds.values()) / len(speeds)
        weights = {rid: s / mean for rid, s in speeds.items()}
        old = self.weights
        if old and all(abs(w - old.get(rid, 1.0)) <= self.REWEIGHT_CHANGE * old.get(rid, 1.0)
                       for rid, w in weights.items()):
            return
        self.weights = weights
        self.update(self.replicas)

    def bound(self, r: Replica, group_load: int) -> int:
        return math.ceil(self.load_factor * (group_load + 1) * r.max_inflight / (self._capacity or self._total()))

    def fits(self, r: Replica, group_load: int) -> bool:
        """``r`` has a slot and is under its load bound."""
        load = len(r.inflight)
        return load < r.max_inflight and load < self.bound(r, group_load)

    def choose(self, session_id: str, group_load: int, with_room: Collection[Replica],
               req: Request | None = None) -> Replica | None:
        if not self.replicas or not with_room:
            return None
        nearly_full = len(with_room) * 8 < len(self.replicas)
        if nearly_full and not self.wait_for_home:
            # Nearly saturated: the session's own replica is almost surely full, and walking the ring
            # to the few with room costs VNODES x n / |with_room| steps. Take the best of those.
            return self._best_with_room(with_room, group_load)
        if self._stale:
            self._rebuild()
        start = self._starts.get(session_id)
        if start is None:
            if len(self._starts) >= self.STARTS_KEPT:
                self._starts.clear()
            start = self._starts[session_id] = bisect.bisect(self._ring, _hash64(session_id))
        size = len(self._ring)
        if self.wait_for_home:
            home = self._owners[start % size]
            if len(home.inflight) >= home.max_inflight:
                return None  # its prefix is cached there: wait for a slot rather than compute it again
            if self.fits(home, group_load):
                return home
            if nearly_full:
                return self._best_with_room(with_room, group_load)
        for k in range(min(size, self.WALK)):
            r = self._owners[(start + k) % size]
            if self.fits(r, group_load):
                return r
        return self._best_with_room(with_room, group_load)

    def _best_with_room(self, with_room: Collection[Replica], group_load: int) -> Replica | None:
        """The replica with room furthest below its bound."""
        best, best_room = None, 0
        for r in with_room:
            room = min(r.max_inflight, self.bound(r, group_load)) - len(r.inflight)
            if room > best_room:
                best, best_room = r, room
        return best


class KvAware(Policy):
    """A turn goes to the replica holding the longest cached prefix of its prompt, by the engines' own
    KV events (:class:`~toolkit.router.kv_index.KvIndex`), among those within the consistent-hash load
    bound (``load_factor``); least loaded among equals. A prompt whose first block is cached on no such
    replica goes by consistent hashing on its session, which also places replicas without events."""

    def __init__(self, replicas: list[Replica], load_factor: float, index: KvIndex, wait_for_home: bool) -> None:
        self.index = index
        self.wait_for_home = wait_for_home
        """``router.affinity=wait``: a turn whose longest cached prefix is on a full replica waits for it."""
        self.hashing = ConsistentHash(replicas, load_factor, wait_for_home)
        self._among: int | None = None
        super().__init__(replicas)
        self.update(replicas)

    def update(self, replicas: list[Replica]) -> None:
        self.replicas = replicas
        self.hashing.update(replicas)
        self._among = None  # at the next choice: not a pass over the fleet per replica that joins

    @property
    def among(self) -> int:
        """The bitmask of the replicas whose events the index holds."""
        if self._among is None:
            self._among = self.index.mask(self.replicas)
        return self._among

    def reweight(self) -> None:
        self.hashing.reweight()

    def choose(self, session_id: str, group_load: int, with_room: Collection[Replica],
               req: Request | None = None) -> Replica | None:
        if req is not None and self.among and with_room:
            r, tokens = self.index.longest(req, self.among, lambda r: self.hashing.fits(r, group_load),
                                           wait=self.wait_for_home)
            if tokens == WAIT:
                return None  # its prefix is cached on a full replica: wait for a slot rather than compute it again
            if r is not None:
                req.kv_found = (r, tokens)
                return r
        return self.hashing.choose(session_id, group_load, with_room)


POLICIES: dict[RouterPolicyName, Callable[[list[Replica], float, int, Affinity, KvIndex | None], Policy]] = {
    RouterPolicyName.consistent_hash: lambda replicas, load_factor, seed, affinity, index: ConsistentHash(
        replicas, load_factor, affinity == Affinity.wait),
    RouterPolicyName.least_loaded: lambda replicas, load_factor, seed, affinity, index: LeastLoaded(replicas),
    RouterPolicyName.power_of_two: lambda replicas, load_factor, seed, affinity, index: PowerOfTwo(replicas, seed),
    RouterPolicyName.round_robin: lambda replicas, load_factor, seed, affinity, index: RoundRobin(replicas),
    RouterPolicyName.kv_aware: lambda replicas, load_factor, seed, affinity, index: KvAware(
        replicas, load_factor, index or KvIndex(lambda r, why: None), affinity == Affinity.wait),
}
"""``router.policy``'s implementations, one per :class:`~toolkit.config.RouterPolicyName`, each making one
for a group from its replicas, ``router.load_factor``, a seed, ``router.affinity`` and the router's KV
index (a new one: a class here, its name in the enum and its line)."""


def make_policy(name: RouterPolicyName | str, replicas: list[Replica], load_factor: float = 1.25,
                seed: int = 0, affinity: Affinity = Affinity.spill, index: KvIndex | None = None) -> Policy:
    """``router.policy`` ``name``'s policy over ``replicas`` (a name the enum lacks: a ConfigError naming
    the options, for a config built in code that ``validate`` did not see)."""
    try:
        make = POLICIES[RouterPolicyName(name)]
    except ValueError:
        raise ConfigError([FieldError("router.policy", name, f"one of {list(POLICIES)}")]) from None
    return make(replicas, load_factor, seed, affinity, index)
