"""The router's replicas and their dispatch slots.

Every replica that registered is known by its socket identity and by its id. Only a *serving* one
(probed ready, not draining) is in a :class:`GroupPool`: it counts toward the pool's capacity and
spare slots, the pool's policy may choose it, and its limits bound what the pool accepts. There is one
pool per group, one for all groups together (key ``None``) and, when a tail policy keeps the tail group
for long runners, one for every group but that one (key :data:`BULK`), so a dispatch decision reads
counts instead of scanning replicas.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable

import msgspec

from toolkit.config import RouterConfig
from toolkit.core import protocol as P
from toolkit.core.tokens import ids_below
from toolkit.router.kv_admission import KvAdmission
from toolkit.router.kv_index import KvIndex
from toolkit.router.policy import Policy, make_policy
from toolkit.router.queue import Request, plain
from toolkit.router.replica import Replica

logger = logging.getLogger(__name__)

BULK = "\x00bulk"
"""Key of the serving replicas outside the reserved (tail) group."""

ENGINE_TIME = ("engine_steps", "prefill_tokens", "model_s", "active_s")
"""The engine counters of ``ReplicaStats`` a group sums (where its engines' time went)."""

PoolKey = str | None
"""A group's name, :data:`BULK`, or None (every group)."""


class GroupPool:
    """The serving replicas under one key, their policy and their slot counts (kept by :class:`ReplicaPool`)."""

    __slots__ = ("members", "policy", "capacity", "spare_slots", "with_room", "limits", "generated_tokens",
                 "replica_s", "busy_s", "engine")

    def __init__(self) -> None:
        self.members: list[Replica] = []
        self.policy: Policy | None = None
        """Made when the first member joins."""
        self.capacity = 0
        """Slots of its members; changes only when one joins or leaves."""
        self.spare_slots = 0
        """Slots of its members that no request holds."""
        self.with_room: dict[Replica, None] = {}
        """Members with a spare slot (an insertion-ordered set)."""
        self.limits: tuple[int, int] | None = None
        """Smallest (max_model_len, vocab_size) over its members; None without members."""
        self.generated_tokens = 0
        """Tokens its group's replicas generated since the router started (heartbeat increments; kept
        under a group's own key only)."""
        self.replica_s = 0.0
        """Replica-seconds between heartbeats, and of them those in which tokens came out."""
        self.busy_s = 0.0
        self.engine = dict.fromkeys(ENGINE_TIME, 0.0)
        """Its replicas' engine counters (:data:`ENGINE_TIME`), summed from heartbeat increments."""

    def joined(self, r: Replica) -> None:
        """``r`` joined :attr:`members`: the limits take it in without a pass over the others (a fleet of
        thousands joining one by one would otherwise cost a pass each)."""
        lim = self.limits
        self.limits = ((min(lim[0], r.max_model_len), min(lim[1], r.vocab_size)) if lim is not None
                       else (r.max_model_len, r.vocab_size))

    def update_limits(self) -> None:
        m = self.members
        self.limits = (min(r.max_model_len for r in m), min(r.vocab_size for r in m)) if m else None


class ReplicaPool:
    def __init__(self, rcfg: RouterConfig, seed: int, reserved: str | None = None, index: KvIndex | None = None,
                 admission: KvAdmission | None = None) -> None:
        """``index``: what the replicas cache, for ``kv_aware``; ``admission``: the KV budget new sessions
        start under (``router.kv_budget``), if any."""
        self.rcfg = rcfg
        self.seed = seed
        self.index = index
        self.admission = admission
        self.reserved = reserved
        """A group that ``BULK`` leaves out (the tail group, kept for long runners), or None."""
        self._replicas: dict[bytes, Replica] = {}
        """Every registered replica, by socket identity (draining ones too, until they are gone)."""
        self._by_id: dict[str, bytes] = {}
        self._groups: dict[PoolKey, GroupPool] = {None: GroupPool()}
        if reserved is not None:
            self._groups[BULK] = GroupPool()
        self._pools_of: dict[Replica, tuple[GroupPool, ...]] = {}
        """The pools each registered replica counts under (once serving)."""

    # ---- who is known ----------------------------------------------------------------------
    def add(self, r: Replica) -> None:
        """A registered replica: known, not serving until :meth:`set_ready`."""
        self._replicas[r.identity] = r
        self._by_id[r.replica_id] = r.identity
        keys: tuple[PoolKey, ...] = (r.group, None)
        if self.reserved is not None and r.group != self.reserved:
            keys = (r.group, None, BULK)
        self._pools_of[r] = tuple(self._group(k) for k in keys)
        if self.index is not None:
            self.index.add(r)

    def remove(self, r: Replica) -> list[Request]:
        """Forget a replica (it left): out of dispatch and the maps. Returns the requests it held, which
        are the caller's now."""
        self._withdraw(r)
        if self.index is not None:
            self.index.drop(r)  # after its pools' policies let go of its slot
        if self.admission is not None:
            self.admission.drop_replica(r)
        self._pools_of.pop(r, None)
        self._replicas.pop(r.identity, None)
        if self._by_id.get(r.replica_id) == r.identity:
            del self._by_id[r.replica_id]
        orphans = list(r.inflight.values())
        r.inflight.clear()
        return orphans

    def get(self, replica_id: str) -> Replica | None:
        ident = self._by_id.get(replica_id)
        return self._replicas.get(ident) if ident is not None else None

    def known(self, identity: bytes) -> Replica | None:
        """The registered replica of this socket identity, if any."""
        return self._replicas.get(identity)

    def all(self) -> Collection[Replica]:
        """Every registered replica (a live view: copy it to change the pool while iterating)."""
        return self._replicas.values()

    # ---- who serves ------------------------------------------------------------------------
    def set_ready(self, r: Replica) -> None:
        """The replica passed its probe and holds the run's weights: it joins its pools (not if it is
        draining, gone, or in them already: a late acknowledgement changes nothing)."""
        pools = self._pools_of.get(r)
        if pools is None or r.draining or r.ready:
            return
        r.ready = True
        for gp in pools:
            gp.capacity += r.max_inflight
            gp.members.append(r)
            if gp.policy is None:
                gp.policy = make_policy(self.rcfg.policy, gp.members, self.rcfg.load_factor, self.seed,
                                        self.rcfg.affinity, self.index)
            else:
                gp.policy.update(gp.members)
            gp.joined(r)
        self._count_spare(r, r.max_inflight - r.load)
        logger.info("replica %s is ready", r.replica_id)

    def set_unready(self, r: Replica) -> None:
        """Its engine died: out of dispatch until :meth:`set_ready` again; its requests finish meanwhile."""
        self._withdraw(r)
        if self.admission is not None:
            self.admission.drop_replica(r)  # its cache went with its engine
        r.ready = False

    def set_draining(self, r: Replica) -> None:
        """Drained: out of dispatch for good (it stays known until it is gone); its requests finish or move."""
        self._withdraw(r)
        r.draining = True

    def _withdraw(self, r: Replica) -> None:
        """Out of dispatch: its spare slots, its place in its pools' policies, capacity and limits. Its
        in-flight requests are the caller's business."""
        pools = self._pools_of.get(r, ())
        if self.index is not None:
            self.index.set_room(r, False)
        for gp in pools:
            gp.with_room.pop(r, None)
        if not r.serving:  # never counted (not ready), or withdrawn already (draining)
            return
        spare = r.max_inflight - r.load
        for gp in pools:
            gp.spare_slots -= spare
            gp.capacity -= r.max_inflight
            gp.members.remove(r)
            if gp.policy is not None:
                gp.policy.update(gp.members)
            gp.update_limits()

    # ---- slots -----------------------------------------------------------------------------
    def take_slot(self, r: Replica, req: Request) -> None:
        """``req`` runs on ``r`` now: it holds one of ``r``'s slots."""
        r.inflight[req.request_id] = req
        if req.deaths:
            r.suspects += 1
        if not plain(req):
            r.marked += 1
        self._count_spare(r, -1)

    def release_slot(self, r: Replica, req: Request) -> bool:
        """``req`` left ``r`` (answered, expired): its slot is spare again. False if ``r`` did not hold it."""
        if r.inflight.pop(req.request_id, None) is None:
            return False
        if req.deaths:
            r.suspects -= 1
        if not plain(req):
            r.marked -= 1
        self._count_spare(r, +1)
        return True

    def _count_spare(self, r: Replica, delta: int) -> None:
        if r.draining or not r.ready:
            # Its slots left the counts when it began draining, or its engine died (set_ready counts
            # them again): a released one is not offered.
            return
        pools = self._pools_of.get(r)
        if pools is None:  # gone
            return
        has_room = len(r.inflight) < r.max_inflight
        if self.index is not None:
            self.index.set_room(r, has_room)
        for gp in pools:
            gp.spare_slots += delta
            if has_room:
                gp.with_room[r] = None
            else:
                gp.with_room.pop(r, None)

    # ---- what dispatch reads ---------------------------------------------------------------
    def spare_slots(self, key: PoolKey) -> int:
        gp = self._groups.get(key)
        return gp.spare_slots if gp is not None else 0

    def capacity(self, key: PoolKey) -> int:
        gp = self._groups.get(key)
        return gp.capacity if gp is not None else 0

    def members(self, key: PoolKey) -> list[Replica]:
        """The serving replicas under ``key`` (the pool's own list: do not change it)."""
        gp = self._groups.get(key)
        return gp.members if gp is not None else []

    def with_room(self, key: PoolKey) -> Collection[Replica]:
        """The serving replicas under ``key`` with a spare slot."""
        gp = self._groups.get(key)
        return gp.with_room.keys() if gp is not None else ()

    def limits(self, key: PoolKey) -> tuple[int, int] | None:
        """Smallest (max_model_len, vocab_size) of the serving replicas under ``key``; None without any."""
        gp = self._groups.get(key)
        return gp.limits if gp is not None else None

    def choose(self, key: PoolKey, session: str, req: Request | None = None) -> Replica | None:
        """The replica under ``key`` the policy gives ``session`` (``req``) now, or None. A request that
        starts a session goes only where the KV budget has room for it."""
        gp = self._groups.get(key)
        if gp is None or gp.spare_slots <= 0 or gp.policy is None:
            return None
        r = gp.policy.choose(session, gp.capacity - gp.spare_slots, gp.with_room, req)
        adm = self.admission
        if r is None or adm is None or req is None or not req.new_session:
            return r
        if key in adm.held_back:  # an earlier job's new session waits for budget here: it starts first
            return None
        if adm.fits(r, req):
            return r
        best = adm.best(gp.with_room, req)
        if best is None:
            adm.held_back.add(key)
        return best

    def choose_for_suspect(self, key: PoolKey) -> Replica | None:
        """A request that was in flight at a death goes where no other suspect runs (least loaded)."""
        gp = self._groups.get(key)
        if gp is None or gp.spare_slots <= 0:
            return None
        cap = self.rcfg.suspects_per_replica
        best = None
        for r in gp.with_room:
            if r.suspects < cap and (best is None or r.load < best.load):
                best = r
        return best

    def reweight(self) -> None:
        """A step boundary: every pool's policy takes in the replicas' learned speeds."""
        for gp in self._groups.values():
            if gp.policy is not None:
                gp.policy.reweight()

    # ---- heartbeats and status -------------------------------------------------------------
    def count_generated(self, r: Replica, before: P.ReplicaStats, now: P.ReplicaStats, interval_s: float) -> None:
        """``r``'s counters went from ``before`` to ``now`` in the ``interval_s`` since its last heartbeat
        (an increment below 0 is an engine that restarted: nothing counted)."""
        gp = self._group(r.group)
        tokens = max(0, now.generated_tokens - before.generated_tokens)
        gp.generated_tokens += tokens
        gp.replica_s += interval_s
        if tokens > 0:
            gp.busy_s += interval_s
        for name in ENGINE_TIME:
            gp.engine[name] += max(0, getattr(now, name) - getattr(before, name))

    def group_status(self, names: Iterable[str], stale: Callable[[Replica], bool]) -> dict[str, P.GroupStatus]:
        """Per group (``names`` and any group a replica registered under): counts and learned speeds;
        ``stale``: a replica kept out of service by a failed weight load."""
        out = {}
        replicas = list(self._replicas.values())
        for name in sorted(set(names) | {r.group for r in replicas}):
            members = [r for r in replicas if r.group == name]
            serving = [r for r in members if r.serving]
            gp = self._groups.get(name)
            out[name] = P.GroupStatus(
                registered=len(members),
                ready=len(serving),
                inflight=sum(r.load for r in members),
                generated_tokens=gp.generated_tokens if gp is not None else 0,
                draining=sum(r.draining for r in members),
                tokens_per_s=sum(r.speed.tokens_per_s for r in serving),
                request_tokens_per_s=max((r.speed.request_tokens_per_s for r in serving), default=0.0),
                peak_tokens_per_s=sum(r.speed.peak_tokens_per_s for r in serving),
                peak_request_tokens_per_s=max((r.speed.peak_request_tokens_per_s for r in serving), default=0.0),
                stale_weights=sum(stale(r) for r in members),
                replica_s=gp.replica_s if gp is not None else 0.0,
                busy_s=gp.busy_s if gp is not None else 0.0,
                engine_steps=int(gp.engine["engine_steps"]) if gp is not None else 0,
                prefill_tokens=int(gp.engine["prefill_tokens"]) if gp is not None else 0,
                model_s=gp.engine["model_s"] if gp is not None else 0.0,
                active_s=gp.engine["active_s"] if gp is not None else 0.0,
            )
        return out

    def _group(self, key: PoolKey) -> GroupPool:
        gp = self._groups.get(key)
        if gp is None:
            gp = self._groups[key] = GroupPool()
        return gp


def limit_error(req: Request, max_model_len: int, vocab_size: int) -> str:
    """Why ``req`` cannot run on a replica with these limits, or "". Its token ids are checked once per
    smaller vocabulary (``Request.ids_below``), by msgspec in C: a Python ``min`` and ``max`` over a long
    context cost the router more than its choice of replica."""
    ids = req.msg.prompt_token_ids
    if len(ids) >= max_model_len:  # (no room for one token: vLLM refuses it)
        return f"prompt of {len(ids)} tokens leaves no room for an output token in max_model_len {max_model_len}"
    if 0 < req.ids_below <= vocab_size:
        return ""
    try:
        msgspec.convert((ids,), ids_below(vocab_size))
    except msgspec.ValidationError as exc:
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= vocab_size:
            return f"token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab_size})"
        return f"prompt_token_ids: {exc}"
    req.ids_below = vocab_size
    return ""
