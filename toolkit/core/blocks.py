"""Prefix-cache block hashes as the toolkit names them: a chain over whole blocks of token ids.

Block ``i``'s hash is ``hash((hash of block i-1, its tokens))`` (0 before the first): a block's hash names
its whole prefix, as an engine's prefix-cache key does. Python's hash of a tuple of ints is the same in
every process of one interpreter build (no hash seed enters it), so the router, the sim and a vLLM
replica (which maps its engine's own hashes onto these: ``toolkit/engine/vllm_kv.py``) agree on them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

ROOT = 0
"""The parent of a chain's first block."""


def block_hashes(tokens: Sequence[int], block_size: int, known: Sequence[int] | None = None) -> list[int]:
    """The chained hash of each whole block of ``tokens``; ``known``: those of a prefix of its blocks,
    already computed (the chain goes on from them)."""
    out = list(known or ())
    h = out[-1] if out else ROOT
    start = len(out) * block_size
    t = tuple(tokens[start:])  # slices of a tuple are the blocks' tuples: one copy each, not two
    for i in range(0, len(t) - block_size + 1, block_size):
        h = hash((h, t[i : i + block_size]))
        out.append(h)
    return out


def chain_from(parent: int, tokens: Sequence[int], block_size: int) -> list[int]:
    """The hashes of the whole blocks of ``tokens`` following a block whose hash is ``parent``."""
    out = []
    h = parent
    t = tuple(tokens)
    for i in range(0, len(t) - block_size + 1, block_size):
        h = hash((h, t[i : i + block_size]))
        out.append(h)
    return out


def extends(tokens: Sequence[int], block_size: int, known: Sequence[int]) -> bool:
    """Whether ``tokens`` goes on from the prompt whose chain is ``known``: its first and last whole blocks
    are checked exactly (each hash from the tokens here and its parent's), not the blocks between them
    (hashing them is what a chain saves; a prompt rewritten in the middle costs a misprediction)."""
    k = len(known)
    return bool(k) and k * block_size <= len(tokens) and hash((ROOT, tuple(tokens[:block_size]))) == known[0] and (
        k == 1 or hash((known[-2], tuple(tokens[(k - 1) * block_size : k * block_size]))) == known[-1])


class Chains:
    """The last prompt's chain of each of the ``keep`` most recent keys (sessions; the oldest dropped
    first), so that a session's next prompt, which goes on from its last, hashes only its new blocks."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._last: dict[Hashable, list[int]] = {}

    def __len__(self) -> int:
        return len(self._last)

    def get(self, key: Hashable) -> list[int] | None:
        return self._last.get(key)

    def put(self, key: Hashable, hashes: list[int]) -> None:
        """``hashes`` is ``key``'s last chain now (the newest)."""
        self._last.pop(key, None)
        self._last[key] = hashes
        if len(self._last) > self.keep:
            del self._last[next(iter(self._last))]

    def forget(self, key: Hashable) -> None:
        self._last.pop(key, None)

    def extend(self, key: Hashable, tokens: Sequence[int], block_size: int) -> tuple[list[int], int]:
        """``tokens``' chain at ``block_size``, which becomes ``key``'s last, and how many of its first blocks
        are those of ``key``'s last chain (taken from it, not hashed again)."""
        known = self._last.get(key)
        kept = len(known) if known is not None and extends(tokens, block_size, known) else 0
        hashes = block_hashes(tokens, block_size, known if kept else None)
        self.put(key, hashes)
        return hashes, kept
