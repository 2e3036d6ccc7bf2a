"""Token ids drawn with numpy as a Python list whose ints are shared: one int object per id of the
vocabulary, made once, instead of a new one per token (``ndarray.tolist``). A twin of thousands of
sessions holds millions of token ids, and allocating each cost more than drawing it."""

from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=4)
def _ints(vocab_size: int) -> np.ndarray:
    return np.arange(vocab_size).astype(object)


def id_list(ids: np.ndarray, vocab_size: int) -> list[int]:
    """``ids.tolist()``, for ids in ``[0, vocab_size)`` (the caller drew them there: a negative id would
    index from the end)."""
    return _ints(vocab_size)[ids].tolist()
