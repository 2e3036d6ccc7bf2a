"""Token ids from elsewhere (a client, an environment) checked against a bound by msgspec, in C and in
one pass (:func:`ids_below`)."""

from __future__ import annotations

import functools
from typing import Annotated, Any

import msgspec


@functools.lru_cache(maxsize=16)
def ids_below(limit: int) -> Any:
    """A one-field, array-like Struct of token ids in ``[0, limit)``: ``msgspec.convert((ids,), ids_below(n))``
    checks a list of ints in C (``.ids``: a copy). A Struct, since msgspec finds its converter on the
    class, where it hashes a ``list[Annotated[...]]`` type in Python at every call (2 us, as long as the
    check of 100 ids)."""
    ids = list[Annotated[int, msgspec.Meta(ge=0, lt=limit)]]
    return msgspec.defstruct(f"IdsBelow{limit}", [("ids", ids)], array_like=True)
