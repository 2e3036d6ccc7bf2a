"""Prefix-cache block hashes as the toolkit names them: a chain over whole blocks of token ids.

Block ``i``'s hash is ``hash((hash of block i-1, its tokens))`` (0 before the first): a block's hash names
its whole prefix, as an engine's prefix-cache key does. Python's hash of a tuple of ints is the same in
every process of one interpreter build (no hash seed enters it), so the router, the sim and a vLLM
replica (which maps its engine's own hashes onto these: ``toolkit/engine/vllm_kv.py``) agree on them.
"""

from __future__ import annotations

from collections.abc import Sequence

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
