"""The router's index of what every replica's prefix cache holds, built from the engines' own KV events.

Each replica that reports events (``Register.kv_block_size``) gets a slot; a block hash maps to the
bitmask of the slots that hold it, so the replicas sharing a request's longest cached prefix are a
few integer ANDs down its block chain. Batches are numbered per replica: one that does not follow the
last makes the index drop what it knew of that replica and ask for a ``KvSnapshot`` (its batches are
ignored until the snapshot comes). A replica that leaves, or registers again, is cleared.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from toolkit.core import clock
from toolkit.core import protocol as P
from toolkit.core.blocks import Chains, block_hashes
from toolkit.router.queue import Request
from toolkit.router.replica import Replica

logger = logging.getLogger(__name__)

WAIT = -1
"""``longest``'s prefix when the turn waits for the replica holding its longest prefix."""
CHAINS_KEPT = 65536
"""Sessions whose last prompt's block hashes are kept, so a next turn hashes only its new tokens."""


RESYNC_AGAIN_S = 10.0
"""A replica whose snapshot has not come this long after it was asked (a message lost to a reconnect, an
undecodable answer dropped) is asked again at its next heartbeat."""

class KvIndex:
    def __init__(self, resync: Callable[[Replica, str], None]) -> None:
        """``resync``: asks a replica for a snapshot of its blocks (sends it ``KvResync``)."""
        self._resync = resync
        self.holders: dict[int, int] = {}
        """Block hash -> bitmask of the slots whose replica holds it."""
        self._blocks: list[set[int]] = []
        """Per slot: the hashes its replica holds."""
        self._owner: list[Replica | None] = []
        self._free: list[int] = []
        self._seq: dict[Replica, int | None] = {}
        """Per replica: the last batch applied (None: waiting for a snapshot)."""
        self._asked_at: dict[Replica, float] = {}
        """Per replica waiting for a snapshot: when it was asked (``clock.monotonic``)."""
        self.block_sizes: dict[int, int] = {}
        """Block size -> replicas indexed with it."""
        self._chains = Chains(CHAINS_KEPT)
        """(session, block size) -> its last prompt's block hashes."""
        self.room = 0
        """Bitmask of the slots whose replica serves and has a slot free (kept by the pool)."""
        self.events = 0
        """Block events applied (stored, removed, a clear)."""
        self.resyncs = 0
        self.client_hashed = 0
        """Requests whose block hashes their client sent (the rest are hashed here)."""
        self.client_block_size = 0
        """The block size clients should hash their prompts at (``Route.kv_block_size``): the one block size
        of the replicas that report events; 0 with none or several (the router hashes then)."""

    # ---- replicas --------------------------------------------------------------------------------
    def add(self, r: Replica) -> None:
        """``r`` registered with KV events: a slot, empty, and a snapshot asked for."""
        if r.kv_block_size <= 0 or r.kv_slot >= 0:
            return
        slot = self._free.pop() if self._free else len(self._blocks)
        if slot == len(self._blocks):
            self._blocks.append(set())
            self._owner.append(None)
        r.kv_slot = slot  # a freed slot's blocks went with its last owner (drop)
        self._owner[slot] = r
        self.block_sizes[r.kv_block_size] = self.block_sizes.get(r.kv_block_size, 0) + 1
        self._sized()
        self._ask(r, "registered")

    def set_room(self, r: Replica, room: bool) -> None:
        if r.kv_slot >= 0:
            self.room = self.room | (1 << r.kv_slot) if room else self.room & ~(1 << r.kv_slot)

    def drop(self, r: Replica) -> None:
        """``r`` left: its blocks and slot go."""
        if r.kv_slot < 0:
            return
        self.set_room(r, False)
        self._clear(r)
        self._owner[r.kv_slot] = None
        self._free.append(r.kv_slot)
        n = self.block_sizes[r.kv_block_size] - 1
        if n:
            self.block_sizes[r.kv_block_size] = n
        else:
            del self.block_sizes[r.kv_block_size]
        self._sized()
        self._seq.pop(r, None)
        self._asked_at.pop(r, None)
        r.kv_slot = -1

    def _clear(self, r: Replica) -> None:
        bit = 1 << r.kv_slot
        holders = self.holders
        blocks = self._blocks[r.kv_slot]
        for h in blocks:
            m = holders.get(h, 0) & ~bit
            if m:
                holders[h] = m
            else:
                holders.pop(h, None)
        blocks.clear()

    def _ask(self, r: Replica, why: str) -> None:
        self._seq[r] = None
        self._asked_at[r] = clock.monotonic()
        self.resyncs += 1
        self._resync(r, why)

    # ---- events in -------------------------------------------------------------------------------
    def apply(self, r: Replica, msg: P.KvEvents) -> None:
        if r.kv_slot < 0:
            return
        last = self._seq.get(r)
        if last is None or msg.seq <= last:  # waiting for a snapshot, or a batch the snapshot holds
            return
        if msg.seq != last + 1:
            logger.warning("replica %s: KV events batch %d after %d; asking for a snapshot", r.replica_id,
                           msg.seq, last)
            self._clear(r)
            self._ask(r, f"batch {msg.seq} came after {last}")
            return
        self._seq[r] = msg.seq
        if msg.cleared:
            self._clear(r)
            self.events += 1
        if msg.stored:
            self._store(r, msg.stored)
        if msg.removed:
            self._remove(r, msg.removed)

    def heard(self, r: Replica, seq: int) -> None:
        """``r`` says its last batch is ``seq`` (a heartbeat, sent after it): one not applied by now was
        lost, found out here rather than by the next batch (which an idle replica may never send)."""
        last = self._seq.get(r)
        if r.kv_slot >= 0 and last is None and r in self._seq:
            if clock.monotonic() - self._asked_at.get(r, 0.0) > RESYNC_AGAIN_S:  # the ask or its answer was lost
                logger.warning("replica %s: no KV snapshot %.0fs after asking; asking again", r.replica_id,
                               RESYNC_AGAIN_S)
                self._ask(r, "the snapshot asked for did not come")
            return
        if r.kv_slot >= 0 and last is not None and seq > last:
            logger.warning("replica %s: KV events batch %d missing (last applied %d); asking for a snapshot",
                           r.replica_id, seq, last)
            self._clear(r)
            self._ask(r, f"batch {seq} was sent, {last} is the last that came")

    def snapshot(self, r: Replica, msg: P.KvSnapshot) -> None:
        if r.kv_slot < 0:
            return
        self._clear(r)
        self._store(r, msg.blocks)
        self._seq[r] = msg.seq
        self._asked_at.pop(r, None)

    def _store(self, r: Replica, hashes: Iterable[int]) -> None:
        # Block by block, no set built: a batch holds a block or two (a turn's new ones), and building
        # sets for them cost more than the changes themselves.
        blocks = self._blocks[r.kv_slot]
        bit = 1 << r.kv_slot
        holders = self.holders
        get = holders.get
        n = len(blocks)
        for h in hashes:
            if h not in blocks:
                blocks.add(h)
                holders[h] = get(h, 0) | bit
        self.events += len(blocks) - n

    def _remove(self, r: Replica, hashes: Iterable[int]) -> None:
        blocks = self._blocks[r.kv_slot]
        keep = ~(1 << r.kv_slot)
        holders = self.holders
        n = len(blocks)
        for h in hashes:
            if h in blocks:
                blocks.discard(h)
                m = holders[h] & keep
                if m:
                    holders[h] = m
                else:
                    del holders[h]
        self.events += n - len(blocks)

    # ---- what routing reads ----------------------------------------------------------------------
    def mask(self, replicas: Iterable[Replica]) -> int:
        """The bitmask of the slots of ``replicas`` that report events."""
        m = 0
        for r in replicas:
            if r.kv_slot >= 0:
                m |= 1 << r.kv_slot
        return m

    def cached_blocks(self, r: Replica) -> int:
        return len(self._blocks[r.kv_slot]) if r.kv_slot >= 0 else 0

    @property
    def size(self) -> int:
        """Distinct blocks held anywhere."""
        return len(self.holders)

    def hashes(self, req: Request, block_size: int) -> list[int]:
        """``req``'s prompt's block hashes at ``block_size`` (kept on it): its client's when it sent them
        (:meth:`_given`), else hashed here, going on from its session's last prompt when this one extends it."""
        tokens = req.msg.prompt_token_ids
        got = req.kv_hashes.get(block_size)
        if got is not None:
            if len(got) == len(tokens) // block_size:
                return got
            # A move's continuation: its prompt is the first leg's plus the tokens made so far.
            got = req.kv_hashes[block_size] = block_hashes(tokens, block_size, got)
            return got
        session = req.msg.session_id
        key = (session, block_size)
        if req.msg.block_size == block_size and req.msg.block_hashes is not None:
            given = self._given(req, key if session else None, block_size)
            if given is not None:
                req.kv_hashes[block_size] = given
                return given
        if not session:
            hashes = req.kv_hashes[block_size] = block_hashes(tokens, block_size)
            return hashes
        hashes = req.kv_hashes[block_size] = self._chains.extend(key, tokens, block_size)[0]
        return hashes

    def _given(self, req: Request, key: tuple[str, int] | None, block_size: int) -> list[int] | None:
        """The chain ``req``'s client sent (``Generate.block_hashes``: its blocks from ``hashes_from`` on, those
        before being its session's last prompt's, kept here), or None when it does not fit the prompt or
        what is kept here (the router restarted, the session's chain was dropped): hashed here then. Only
        routing reads it: a wrong one costs its own turn a cache miss, never a wrong output."""
        msg = req.msg
        given = msg.block_hashes
        assert given is not None
        k = msg.hashes_from
        if k:
            known = self._chains.get(key) if key is not None else None
            if known is None or len(known) != k:
                return None
            hashes = known + given
        else:
            hashes = given
        if len(hashes) != len(msg.prompt_token_ids) // block_size:
            return None
        if key is not None:
            self._chains.put(key, hashes)
        self.client_hashed += 1
        return hashes

    def forget_session(self, session_id: str) -> None:
        for bs in self.block_sizes:
            self._chains.forget((session_id, bs))

    def _sized(self) -> None:
        """:attr:`client_block_size` after a change of :attr:`block_sizes`."""
        sizes = self.block_sizes
        self.client_block_size = next(iter(sizes)) if len(sizes) == 1 else 0

    def prefix_on(self, req: Request, r: Replica) -> int:
        """Tokens of ``req``'s prompt (but its last) the index says ``r`` holds."""
        if r.kv_slot < 0:
            return 0
        return len(self._walk(self._usable(req, r.kv_block_size), 1 << r.kv_slot)) * r.kv_block_size

    def _usable(self, req: Request, bs: int) -> list[int]:
        """``req``'s block hashes at ``bs`` that routing counts: all but a block ending on its last token;
        none of a LoRA turn's (an adapter's KV is hashed with its name, and the engines report only the
        base model's blocks: it goes by consistent hashing, and counts no predicted hit)."""
        if req.msg.lora:
            return []
        hs = self.hashes(req, bs)
        return hs if len(hs) * bs < len(req.msg.prompt_token_ids) else hs[:-1]

    def _holding_all(self, hs: list[int], among: int) -> int:
        """The slots of ``among`` holding every block of ``hs``: those holding its last block, each checked for
        the rest with one set comparison (C speed, where the walk takes a Python step a block)."""
        whole = self.holders.get(hs[-1], 0) & among if hs else 0
        m = whole
        while m:
            low = m & -m
            m ^= low
            if not self._blocks[low.bit_length() - 1].issuperset(hs):
                whole ^= low
        return whole

    def _walk(self, hs: list[int], among: int) -> list[int]:
        """Down the blocks ``hs``: entry ``d`` is the slots of ``among`` holding blocks ``0..d``, until none does."""
        holders = self.holders
        levels = []
        m = among
        for h in hs:
            m &= holders.get(h, 0)
            if not m:
                break
            levels.append(m)
        return levels

    def longest(self, req: Request, among: int, fits: Callable[[Replica], bool], with_room: bool = True,
                wait: bool = False) -> tuple[Replica | None, int]:
        """Of the slots in ``among`` (``with_room``: that have a slot free) whose replica ``fits``, the one
        holding the longest prefix of ``req``'s prompt (least loaded among equals), and that prefix in
        tokens; (None, 0) when none holds its first block. The last token is always computed, so at
        most ``len - 1`` tokens count. ``wait``: (None, WAIT) when the replica holding the longest prefix
        of all ``among`` (room or not) has no slot free: the turn waits for it (the same walk)."""
        room = self.room if with_room else -1
        if not wait:
            among &= room
        one_size = len(self.block_sizes) == 1
        best: Replica | None = None
        best_tokens = 0
        home: Replica | None = None
        home_tokens = 0
        for bs in self.block_sizes:
            hs = self._usable(req, bs)
            if one_size:
                # A turn whose whole prefix is cached somewhere (a session's next turn, mostly) is settled by
                # the replicas holding all of it; what that does not settle, the walk does, with the same
                # answer. (With several block sizes another size may hold more: the walks compare them.)
                whole = self._holding_all(hs, among)
                if whole:
                    if wait:
                        held = self._best_of(whole, _anywhere)
                        if held is not None and not held.has_room:
                            return None, WAIT
                    r = self._best_of(whole & room, fits)
                    if r is not None:
                        return r, len(hs) * bs
            levels = self._walk(hs, among)
            if wait and len(levels) * bs > home_tokens:
                home, home_tokens = self._best_of(levels[-1], _anywhere), len(levels) * bs
            tried = 0
            for depth in range(len(levels), 0, -1):
                if depth * bs <= best_tokens:
                    break
                fresh = levels[depth - 1] & room & ~tried  # deeper levels' replicas were tried already
                tried |= fresh
                r = self._best_of(fresh, fits) if fresh else None
                if r is not None:
                    best, best_tokens = r, depth * bs
                    break
        if home is not None and not home.has_room:
            return None, WAIT
        return best, best_tokens

    def _best_of(self, mask: int, fits: Callable[[Replica], bool]) -> Replica | None:
        best = None
        owner = self._owner
        while mask:
            low = mask & -mask
            r = owner[low.bit_length() - 1]
            mask ^= low
            if r is not None and fits(r) and (best is None or len(r.inflight) < len(best.inflight)):
                best = r
        return best


def _anywhere(r: Replica) -> bool:
    return True
