"""Token ids as lists of shared ints."""

from __future__ import annotations

import numpy as np

from toolkit.core.tokens import id_list


def test_id_list_is_tolist_with_one_int_object_per_id() -> None:
    ids = np.random.default_rng(0).integers(1000, 5000, size=400)  # past the ints Python itself shares
    out = id_list(ids, 5000)
    assert out == ids.tolist() and all(type(t) is int for t in out)
    again = id_list(ids, 5000)
    assert all(a is b for a, b in zip(out, again, strict=True))  # the same objects: none made per token
    assert id_list(np.array([], dtype=np.int64), 5000) == []
