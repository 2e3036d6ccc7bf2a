"""Token id lists, made and checked in C. Ids drawn with numpy become a list whose ints are shared: one
int object per id of the vocabulary, made once, instead of a new one per token (``ndarray.tolist``; a
twin of thousands of sessions holds millions of them). Ids from elsewhere are checked against a bound
by msgspec in one pass (:func:`ids_below`)."""

from __future__ import annotations

import functools
from typing import Annotated, Any

import msgspec
import numpy as np


@functools.lru_cache(maxsize=4)
def _ints(vocab_size: int) -> np.ndarray:
    return np.arange(vocab_size).astype(object)


def id_list(ids: np.ndarray, vocab_size: int) -> list[int]:
    """``ids.tolist()``, for ids in ``[0, vocab_size)`` (the caller drew them there: a negative id would
    index from the end)."""
    return _ints(vocab_size)[ids].tolist()


@functools.lru_cache(maxsize=16)
def ids_below(limit: int) -> Any:
    """A one-field, array-like Struct of token ids in ``[0, limit)``: ``msgspec.convert((ids,), ids_below(n))``
    checks a list of ints in C (``.ids``: a copy). A Struct, since msgspec finds its converter on the
    class, where it hashes a ``list[Annotated[...]]`` type in Python at every call (2 us, as long as the
    check of 100 ids)."""
    ids = list[Annotated[int, msgspec.Meta(ge=0, lt=limit)]]
    return msgspec.defstruct(f"IdsBelow{limit}", [("ids", ids)], array_like=True)
