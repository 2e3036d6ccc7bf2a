"""Seeded draws (``toolkit/core/draws.py``): a generator named by a key, pinned across processes, and
token ids as windows of a pool whose objects they share."""

from __future__ import annotations

import numpy as np

from toolkit.core.draws import POOL, id_pool, id_window, seeded, window


def test_a_key_names_the_same_draws_in_every_process() -> None:
    here = seeded(7, b"a", b"b").integers(0, 1 << 62, size=3).tolist()
    assert seeded(7, b"a", b"b").integers(0, 1 << 62, size=3).tolist() == here
    assert seeded(7, b"a", b"c").integers(0, 1 << 62, size=3).tolist() != here
    # Pinned: blake2b, not Python's seeded hash of the strings, so a real run and its twin draw alike.
    assert here == [1898554494206547962, 3661458550222882345, 1464119163663912938]


def test_an_id_window_is_the_pools_objects_after_two_ids_drawn_apart() -> None:
    pool = id_pool(32000)
    assert len(pool) == POOL and all(0 < t < 32000 for t in pool) and id_pool(32000) is pool
    ids, start = id_window(np.random.default_rng(3), 32000, 5000)
    assert len(ids) == 5000 and all(0 < t < 32000 for t in ids)
    assert ids[2:] == window(pool, start, 5000)[2:]
    assert all(a is b for a, b in zip(ids[2:], pool[start + 2 :], strict=False))  # its objects, not copies
    firsts = {tuple(id_window(np.random.default_rng(i), 32000, 8)[0][:2]) for i in range(500)}
    assert len(firsts) == 500  # two lists start alike 1 in POOL * 31999 ** 2
    assert id_window(np.random.default_rng(1), 32000, 1)[0][0] in range(1, 32000)
    assert id_window(np.random.default_rng(1), 32000, 0)[0] == []
    assert all(t == 1 for t in id_window(np.random.default_rng(1), 2, 50)[0])  # a vocabulary of one id


def test_a_window_goes_round_past_the_pools_end() -> None:
    pool = list(range(10))
    assert window(pool, 7, 5) == [7, 8, 9, 0, 1]
    assert window(pool, 3, 25) == [*range(3, 10), *range(10), *range(8)]
    assert window(pool, 0, 0) == []
