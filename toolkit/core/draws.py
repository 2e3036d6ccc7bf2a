"""Seeded draws, cheap enough to make one per request: this thread's PCG64 generator put in the state a
key names (:func:`seeded`), and token ids as windows of a pool drawn once per vocabulary
(:func:`id_window`), whose int objects lie together in memory. The sim's plans and the synthetic
prompts draw with them: the same key gives the same draws in every process."""

from __future__ import annotations

import functools
import hashlib
import threading
from typing import Any

import numpy as np

POOL = 1 << 16
"""Ids in a vocabulary's pool (:func:`id_pool`); a window begins at any of them."""


class _Generator(threading.local):
    """This thread's one PCG64 generator: setting its state costs 2 us where a new seeded generator
    costs 18 (numpy's SeedSequence)."""

    def __init__(self) -> None:
        self.bits = np.random.PCG64()
        self.gen = np.random.Generator(self.bits)
        self.state: Any = self.bits.state  # (a dict numpy types as _PCG64State)


_gen = _Generator()


def seeded(key: int, *material: bytes) -> np.random.Generator:
    """This thread's generator, seeded by ``key`` (an int) and ``material`` through blake2b: the same
    draws for the same seed in every process. Valid until the next call on this thread."""
    d = hashlib.blake2b(b"|".join((key.to_bytes(8, "little", signed=True), *material)), digest_size=32).digest()
    st = _gen.state
    st["state"]["state"] = int.from_bytes(d[:16], "little")
    st["state"]["inc"] = int.from_bytes(d[16:], "little") | 1  # a PCG stream's increment is odd
    _gen.bits.state = st
    return _gen.gen


@functools.lru_cache(maxsize=4)
def id_pool(vocab_size: int) -> list[int]:
    """:data:`POOL` ids uniform in ``[1, vocab_size)``, from a fixed seed. Made one after another by
    ``tolist``, their objects lie together: a window's tokens are read again wherever they go (hashed,
    encoded, checked, merged into a sample), and ids spread over the heap cost a cache miss a token."""
    return np.random.Generator(np.random.PCG64(vocab_size)).integers(1, vocab_size, size=POOL).tolist()


def window(pool: list[Any], start: int, n: int) -> list[Any]:
    """``n`` items of ``pool`` from ``start``, round past its end (the pool's objects, not copies)."""
    out = pool[start : start + n]
    while len(out) < n:
        out += pool[: n - len(out)]
    return out


def id_window(rng: np.random.Generator, vocab_size: int, n: int) -> tuple[list[int], int]:
    """``n`` ids in ``[1, vocab_size)`` from one draw of ``rng``: two first ids and where in the pool the rest
    begin, so that two lists start alike 1 in ``POOL * (vocab_size - 1) ** 2`` (one first id for a
    vocabulary past 2**23). Also the window's start (a pool of something else may be read there too)."""
    v = vocab_size - 1
    apart = 2 if POOL * v * v < 1 << 63 else 1
    x = int(rng.integers(0, POOL * v**apart))
    start, x = x % POOL, x // POOL
    ids = window(id_pool(vocab_size), start, n)
    for i in range(min(apart, n)):
        ids[i] = 1 + x % v
        x //= v
    return ids, start
