"""What an engine's prefix cache stored and dropped, as toolkit block hashes (``toolkit.core.blocks``),
until its replica sends it to the router (``KvEvents``): the sim's cache writes here, and vLLM's own
KV events are mapped here (``vllm_kv.py``). Net per block: a block stored and dropped again before the
replica looks is not sent at all."""

from __future__ import annotations

from collections.abc import Iterable

from toolkit.core.protocol import KvEvents, KvSnapshot, encode


class KvEventLog:
    def __init__(self) -> None:
        self._pending: dict[int, bool] = {}
        """Block hash -> held (True: stored, False: removed), the last event of each."""
        self._cleared = False
        self.seq = 0
        """Batches taken so far: the next one's sequence number is ``seq + 1``."""
        self.events = 0
        """Block events recorded since the engine started (stores, removals, one per clear)."""
        self.lose_seq: int | None = None
        """Test hook (``engine.fault_kv_gap_batch``): the batch of this number is lost on the way."""

    def stored(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._pending[h] = True
            self.events += 1

    def removed(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self._pending[h] = False
            self.events += 1

    def cleared(self) -> None:
        """Every block is gone (a weight update, a reset): what was pending is moot."""
        self._pending.clear()
        self._cleared = True
        self.events += 1

    def __bool__(self) -> bool:
        return bool(self._pending) or self._cleared

    def take(self) -> KvEvents | None:
        """The batch since the last one (numbered), or None when nothing happened."""
        if not self:
            return None
        pending, self._pending = self._pending, {}
        self.seq += 1
        msg = KvEvents(seq=self.seq, stored=[h for h, held in pending.items() if held],
                       removed=[h for h, held in pending.items() if not held], cleared=self._cleared)
        self._cleared = False
        return None if self.seq == self.lose_seq else msg

    def frames(self) -> list[bytes]:
        """The batch since the last one as the frame a Result's message carries after its own two (none
        when nothing happened): the router applies it before the Result, in the same message."""
        batch = self.take()
        return [] if batch is None else [encode(batch)[1]]

    def snapshot(self, blocks: list[int]) -> KvSnapshot:
        """``blocks`` (every block the cache holds now) as of the next batch number: what was pending is
        in it, so it is dropped."""
        self.take()
        return KvSnapshot(seq=self.seq, blocks=blocks)
