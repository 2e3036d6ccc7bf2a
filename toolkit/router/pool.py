"""The router's replicas and their dispatch slots.

Every replica that registered is known by its socket identity and by its id. Only a *serving* one
(probed ready, not draining) is in a group: it counts toward the group's capacity and free slots, its
group's policy may choose it, and its limits bound what the group accepts. Every count is kept per
group and for all groups together (key ``None``), and, when a tail policy keeps the tail group for
long runners, for every group but that one (key ``BULK``), so a dispatch decision reads numbers
instead of scanning replicas.
"""

from __future__ import annotations

import logging
from collections import Counter

from toolkit.config import RouterConfig
from toolkit.core import protocol as P
from toolkit.router.policy import Policy, Replica, make_policy
from toolkit.router.queue import Request

logger = logging.getLogger(__name__)


BULK = "\x00bulk"
"""Key of the serving replicas outside the reserved (tail) group."""


class ReplicaPool:
    def __init__(self, rcfg: RouterConfig, seed: int, reserved: str | None = None) -> None:
        self.rcfg = rcfg
        self.seed = seed
        self.reserved = reserved
        """A group that ``BULK`` leaves out (the tail group, kept for long runners), or None."""
        self.replicas: dict[bytes, Replica] = {}
        """Every registered replica, by socket identity (draining ones too, until they are gone)."""
        self.by_id: dict[str, bytes] = {}
        self.groups: dict[str | None, list[Replica]] = {None: []}
        """Serving replicas per group."""
        self.policies: dict[str | None, Policy] = {}
        self.free: Counter[str | None] = Counter()
        """Free slots of the serving replicas per group."""
        self.capacity: Counter[str | None] = Counter()
        """Slots of the serving replicas per group; changes only when one joins or leaves."""
        self.limits: dict[str | None, tuple[int, int]] = {}
        """Smallest (max_model_len, vocab_size) over each group's serving replicas."""
        self.tokens_seen: Counter[str] = Counter()
        """Tokens each group generated since this router started (heartbeat increments)."""
        self.free_sets: dict[str | None, dict[Replica, None]] = {None: {}}
        """Serving replicas with a free slot (insertion-ordered sets)."""
        if reserved is not None:
            self.groups[BULK] = []
            self.free_sets[BULK] = {}

    def keys(self, r: Replica) -> tuple[str | None, ...]:
        """The pool keys ``r`` counts under."""
        if self.reserved is not None and r.group != self.reserved:
            return (r.group, None, BULK)
        return (r.group, None)

    def add(self, r: Replica) -> None:
        """A registered replica: known, not serving until :meth:`set_ready`."""
        self.replicas[r.identity] = r
        self.by_id[r.replica_id] = r.identity

    def remove(self, r: Replica) -> None:
        """Forget a replica (it left): out of dispatch and the maps. Its requests are the caller's."""
        self.replicas.pop(r.identity, None)
        if self.by_id.get(r.replica_id) == r.identity:
            del self.by_id[r.replica_id]
        self.withdraw(r)

    def get(self, replica_id: str) -> Replica | None:
        ident = self.by_id.get(replica_id)
        return self.replicas.get(ident) if ident is not None else None

    def set_ready(self, r: Replica) -> None:
        """The replica answered its probe: it joins its group and the all-groups pool."""
        r.ready = True
        for g in self.keys(r):
            self.capacity[g] += r.max_inflight
            members = self.groups.setdefault(g, [])
            members.append(r)
            if g in self.policies:
                self.policies[g].update(members)
            else:
                self.policies[g] = make_policy(self.rcfg.policy, members, self.rcfg.load_factor, self.seed)
        self.take_slot(r, r.max_inflight - r.load)
        self._update_limits()
        logger.info("replica %s is ready", r.replica_id)

    def withdraw(self, r: Replica) -> None:
        """Take a replica out of dispatch (it left, or began draining): its free slots, its place in
        its group's policy, capacity and limits. Its in-flight requests are the caller's business."""
        for fs in self.free_sets.values():
            fs.pop(r, None)
        if not r.serving:  # never counted (not ready), or withdrawn already (draining)
            return
        spare = r.max_inflight - r.load
        for g in self.keys(r):
            self.free[g] -= spare
            self.capacity[g] -= r.max_inflight
            members = self.groups[g]
            members.remove(r)
            self.policies[g].update(members)
        self._update_limits()

    def take_slot(self, r: Replica, delta: int) -> None:
        """``delta`` slots of ``r`` were freed (> 0) or taken (< 0)."""
        if r.draining or not r.ready:
            # Its slots left the counts when it began draining, or its engine died (set_ready counts
            # them again): freed ones are not offered.
            return
        keys = self.keys(r)
        for g in keys:
            self.free[g] += delta
        has_room = r.ready and len(r.inflight) < r.max_inflight and r.identity in self.replicas
        for fs in (self.free_sets.setdefault(g, {}) for g in keys):
            if has_room:
                fs[r] = None
            else:
                fs.pop(r, None)

    def reweight(self) -> None:
        """A step boundary: every group's policy takes in the replicas' learned speeds."""
        for policy in self.policies.values():
            policy.reweight()

    def choose(self, g: str | None, key: str) -> Replica | None:
        """The replica of group ``g`` (None: any) the policy gives ``key`` (a session) now, or None."""
        if self.free[g] <= 0:
            return None
        policy = self.policies.get(g)
        if policy is None:
            return None
        return policy.choose(key, self.capacity[g] - self.free[g], self.free_sets[g])

    def choose_for_suspect(self, g: str | None) -> Replica | None:
        """A request that was in flight at a death goes where no other suspect runs (least loaded)."""
        if self.free[g] <= 0:
            return None
        cap = self.rcfg.suspects_per_replica
        best = None
        for r in self.free_sets.get(g, {}):
            if r.suspects < cap and (best is None or r.load < best.load):
                best = r
        return best

    def _update_limits(self) -> None:
        self.limits = {g: (min(r.max_model_len for r in members), min(r.vocab_size for r in members))
                       for g, members in self.groups.items() if members}

    def group_status(self, names: set[str]) -> dict[str, P.GroupStatus]:
        """Per group (``names`` and any group a replica registered under): counts and learned speeds."""
        out = {}
        for name in sorted(names | {r.group for r in self.replicas.values()}):
            members = [r for r in self.replicas.values() if r.group == name]
            serving = [r for r in members if r.serving]
            out[name] = P.GroupStatus(
                registered=len(members),
                ready=len(serving),
                inflight=sum(r.load for r in members),
                generated_tokens=self.tokens_seen[name],
                draining=sum(r.draining for r in members),
                tokens_per_s=sum(r.speed.tokens_per_s for r in serving),
                request_tokens_per_s=max((r.speed.request_tokens_per_s for r in serving), default=0.0),
                peak_tokens_per_s=sum(r.speed.peak_tokens_per_s for r in serving),
                peak_request_tokens_per_s=max((r.speed.peak_request_tokens_per_s for r in serving), default=0.0),
                stale_weights=sum(bool(r.weights_error) for r in members),
            )
        return out


def limit_error(req: Request, max_model_len: int, vocab_size: int) -> str:
    """Why ``req`` cannot run on a replica with these limits, or ""."""
    n = len(req.msg.prompt_token_ids)
    if n > max_model_len:
        return f"prompt of {n} tokens is longer than max_model_len {max_model_len}"
    if req.lo < 0 or req.hi >= vocab_size:
        bad = req.lo if req.lo < 0 else req.hi
        return f"token id {bad} outside the vocabulary [0, {vocab_size})"
    return ""
