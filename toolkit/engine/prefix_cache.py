"""The sim engine's prefix cache: an LRU over whole blocks of prompt tokens, named by their chained hashes
(``toolkit.core.blocks``), recording what it stores and drops as KV events when asked to. The twin's
engines and the KV-routing benches use the same one."""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import takewhile

from toolkit.core.blocks import block_hashes
from toolkit.engine.kv_events import KvEventLog


class PrefixCache:
    """LRU over prompt blocks; a block counts as cached only if every block before it is."""

    def __init__(self, block_size: int, capacity_tokens: int) -> None:
        self.block_size = block_size
        self.capacity = max(1, capacity_tokens // block_size)
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.log: KvEventLog | None = None
        """Where the blocks it stores and drops are recorded (the replica's KV events), if anywhere."""

    def hashes(self, tokens: list[int], known: list[int] | None = None) -> list[int]:
        """The chained hash of each whole block of ``tokens`` (``toolkit.core.blocks``); ``known``: those
        of a prefix of its blocks, already computed."""
        return block_hashes(tokens, self.block_size, known)

    def match(self, tokens: list[int], hashes: list[int] | None = None) -> int:
        """Tokens at the start of ``tokens`` already cached (at least one token is always computed);
        ``hashes``: its blocks' (:meth:`hashes`), if known."""
        usable = (len(tokens) - 1) // self.block_size
        blocks = self.blocks
        hits = list(takewhile(blocks.__contains__,
                              hashes[:usable] if hashes is not None else self.hashes(tokens[:-1])))
        deque(map(blocks.move_to_end, hits), maxlen=0)  # each hit the most recent, in order (a loop in C)
        return len(hits) * self.block_size

    def insert(self, tokens: list[int]) -> None:
        """Each whole block of ``tokens`` becomes the most recent, in order (:meth:`store`)."""
        self.store(self.hashes(tokens))

    def store(self, hashes: list[int]) -> None:
        """The blocks named by ``hashes`` (a chain from :meth:`hashes`) become the most recent, in order;
        the least recent beyond the capacity go."""
        blocks, log = self.blocks, self.log
        new = []
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None  # a new key goes to the end: the most recent
                new.append(h)
        if log is not None:
            log.stored(new)
        while len(blocks) > self.capacity:
            h, _ = blocks.popitem(last=False)
            if log is not None:
                log.removed((h,))

    def clear(self) -> None:
        self.blocks.clear()
        if self.log is not None:
            self.log.cleared()
