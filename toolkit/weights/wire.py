"""What a streamed weight update puts on the wire: its manifest, its payload, and how either end makes them.

An update of ``version`` is a :class:`Manifest` (one :class:`TensorSpec` per tensor, in the trainer's
order) and a payload: every tensor's bytes, one after the other, at the offsets the manifest gives. A
tensor is sent ``dense`` (its raw elements) or as a ``delta`` against the update's ``base`` version:
the flat indices of the elements whose bits changed (int32) and their new values. The payload moves in
buckets of ``bucket_bytes`` (:func:`bucket_ranges`), the same on every rank from the total alone.

The two ends work on the elements' bit patterns (numpy unsigned ints of the element's width), so
neither needs torch here: :class:`Encoder` keeps the last state the trainer sent and encodes the next
update against it; :func:`decode` rebuilds the new tensors from a payload and the receiver's state,
and refuses a delta whose base is not the version the receiver holds (:class:`WrongBase`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
import numpy as np

from toolkit.core.errors import ToolkitError

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
            "int32": 4, "int64": 8, "bool": 1}
"""The element widths of the dtypes an update may carry (torch's names)."""
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
INDEX = np.dtype(np.int32)
MAX_DELTA_NUMEL = int(np.iinfo(INDEX).max) + 1
"""A tensor of more elements goes dense: its delta's indices would not fit ``INDEX``."""


class WrongBase(ToolkitError):
    """A delta against another version than the one the receiver holds: refused before anything changes."""


class Encoding(enum.IntEnum):
    DENSE = 0
    DELTA = 1


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    name: str
    """The checkpoint's name of the tensor (the engine's loader maps it)."""
    dtype: str
    """torch's name of its element type (``bfloat16``)."""
    shape: tuple[int, ...]
    encoding: Encoding = Encoding.DENSE
    nnz: int = 0
    """A delta's count of changed elements."""

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """Its bytes in the payload: the elements, or a delta's indices and values."""
        width = ITEMSIZE[self.dtype]
        return self.numel * width if self.encoding == Encoding.DENSE else self.nnz * (INDEX.itemsize + width)


class Manifest(msgspec.Struct, array_like=True, frozen=True):
    version: int
    base: int
    """The version every delta of it applies to (-1: all dense, it applies to any)."""
    tensors: tuple[TensorSpec, ...]
    bucket_bytes: int

    def offsets(self) -> list[int]:
        out, at = [], 0
        for t in self.tensors:
            out.append(at)
            at += t.nbytes
        return out

    @property
    def total(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def dense_bytes(self) -> int:
        """What the same update would be, every tensor dense."""
        return sum(t.numel * ITEMSIZE[t.dtype] for t in self.tensors)

    def buckets(self) -> list[tuple[int, int]]:
        return bucket_ranges(self.total, self.bucket_bytes)


def bucket_ranges(total: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """``[start, end)`` byte ranges of ``bucket_bytes`` (the last one shorter) covering ``total``."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, not {bucket_bytes}")
    return [(s, min(s + bucket_bytes, total)) for s in range(0, total, bucket_bytes)]


def bits(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array``'s elements as unsigned ints of their width (a view: no copy)."""
    width = ITEMSIZE.get(dtype)
    if width is None:
        raise ValueError(f"dtype {dtype!r} cannot be streamed; valid: {', '.join(ITEMSIZE)}")
    if array.dtype.itemsize != width:
        raise ValueError(f"an array of {array.dtype} holds no {dtype} elements ({array.dtype.itemsize} bytes, "
                         f"not {width})")
    return np.ascontiguousarray(array).view(_BITS[width])


@dataclass
class Update:
    """One encoded update: its manifest and its payload's pieces, in manifest order (views, not copies)."""

    manifest: Manifest
    pieces: list[np.ndarray]
    """Per tensor: its elements (dense) or its indices and values (delta), as uint8."""


class Encoder:
    """The trainer's side: the state it last sent (bits per tensor name) and its version."""

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.state: dict[str, np.ndarray] = {}
        """Bits of every tensor last sent, flat."""
        self.specs: dict[str, TensorSpec] = {}
        """Their dtypes and shapes (dense)."""
        self.version: int | None = None
        """The version of ``state`` (None: nothing sent yet)."""
        self._staged: tuple[int | None, dict[str, np.ndarray], dict[str, TensorSpec]] = (None, {}, {})
        """The update last encoded, committed once it landed."""
        self._spare: dict[str, np.ndarray] = {}
        """Arrays of a state no longer needed, written over by the next encode (fresh arrays would
        fault every page in again: a second per GB on a CPU)."""
        self._scratch = np.empty(0, np.bool_)

    def encode(self, version: int, named: Iterable[tuple[str, np.ndarray, str]], delta: bool) -> Update:
        """Encode ``named`` (name, elements, dtype) as ``version``. With ``delta`` (and a state to apply
        it to), a tensor goes as a delta where that is smaller than dense. The state becomes the new
        tensors' bits only through :meth:`commit` (a failed send leaves it as it was)."""
        base = self.version if delta and self.version is not None else -1
        specs: list[TensorSpec] = []
        pieces: list[np.ndarray] = []
        staged: dict[str, np.ndarray] = {}
        for name, array, dtype in named:
            if name in staged:
                raise ValueError(f"tensor {name!r} given twice in one update")
            src = bits(array, dtype).reshape(-1)
            new = self._spare.pop(name, None)
            if new is None or new.shape != src.shape or new.dtype != src.dtype:
                new = np.empty_like(src)
            np.copyto(new, src)  # its own: a trainer's step changes tensors in place
            old = self.state.get(name) if base >= 0 else None
            spec = TensorSpec(name, dtype, tuple(int(d) for d in array.shape))
            if (old is not None and self.specs[name].shape == spec.shape and self.specs[name].dtype == dtype
                    and new.size <= MAX_DELTA_NUMEL):
                idx = self._changed(old, new)
                if idx.size * (INDEX.itemsize + new.itemsize) < new.nbytes:
                    spec = TensorSpec(name, dtype, spec.shape, Encoding.DELTA, int(idx.size))
                    pieces += [idx.view(np.uint8), np.ascontiguousarray(new[idx]).view(np.uint8)]
            if spec.encoding == Encoding.DENSE:
                pieces.append(new.view(np.uint8))
            specs.append(spec)
            staged[name] = new
        if base >= 0 and set(staged) != set(self.state):
            missing = sorted(set(self.state) - set(staged))[:5]
            raise ValueError(f"a delta update must name every tensor of version {base}; missing: {missing}")
        self._staged = (version, staged, {s.name: TensorSpec(s.name, s.dtype, s.shape) for s in specs})
        if not any(s.encoding == Encoding.DELTA for s in specs):
            base = -1
        return Update(Manifest(version, base, tuple(specs), self.bucket_bytes), pieces)

    CHUNK = 1 << 22

    def _changed(self, old: np.ndarray, new: np.ndarray) -> np.ndarray:
        """Flat indices where ``old`` and ``new`` differ, in chunks (one small mask, reused)."""
        if self._scratch.size < min(old.size, self.CHUNK):
            self._scratch = np.empty(min(old.size, self.CHUNK), np.bool_)
        found = []
        for at in range(0, old.size, self.CHUNK):
            n = min(self.CHUNK, old.size - at)
            mask = np.not_equal(old[at:at + n], new[at:at + n], out=self._scratch[:n])
            hit = np.flatnonzero(mask)
            if hit.size:
                found.append((hit + at).astype(INDEX))
        return np.concatenate(found) if found else np.empty(0, INDEX)

    def commit(self, recycle: bool = True) -> None:
        """The last encoded update reached the replicas: it is the base of the next delta. The previous
        state's arrays are written over by the next encode unless ``recycle`` is off (a reader still
        holds them: a dense copy being sent)."""
        previous = self.state
        self.version, self.state, self.specs = self._staged
        self._spare = previous if recycle else {}

    def abandon(self) -> None:
        """The last encoded update did not land: its arrays are the next encode's to write over."""
        if self._staged[1] is not self.state:  # (an encode that raised left the committed state staged)
            self._spare = self._staged[1]

    def dense(self, staged: bool = False) -> Update:
        """The state last committed (or, with ``staged``, the update last encoded), every tensor dense:
        for a replica that missed a version, or an update no replica holds the base of."""
        version, state, specs = self._staged if staged else (self.version, self.state, self.specs)
        if version is None:
            raise ValueError("nothing was sent yet")
        return Update(Manifest(version, -1, tuple(specs.values()), self.bucket_bytes),
                      [a.view(np.uint8) for a in state.values()])


@dataclass
class Parts:
    """A payload split by tensor: dense tensors (views of the payload, shaped) and deltas (indices and
    values, views of the payload), nothing copied."""

    dense: dict[str, np.ndarray]
    deltas: dict[str, tuple[np.ndarray, np.ndarray]]


def check_base(manifest: Manifest, held: int) -> None:
    """Raise WrongBase for a delta update against another version than ``held``."""
    if manifest.base >= 0 and manifest.base != held:
        raise WrongBase(f"update to version {manifest.version} is a delta against version {manifest.base}, "
                        f"but this replica holds version {held}: it needs a dense update")


def delta_of(spec: TensorSpec, piece: np.ndarray, sizes: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """A delta tensor's indices and values from its bytes ``piece`` (views), checked against the
    receiver's elements per tensor ``sizes``."""
    if sizes.get(spec.name) != spec.numel:
        raise WrongBase(f"delta for {spec.name!r}: this replica holds no tensor of {spec.numel} elements there")
    cut = spec.nnz * INDEX.itemsize
    idx, values = piece[:cut].view(INDEX), piece[cut:].view(_BITS[ITEMSIZE[spec.dtype]])
    if idx.size and (idx.min() < 0 or idx.max() >= spec.numel):
        raise ValueError(f"delta for {spec.name!r} indexes outside its {spec.numel} elements")
    return idx, values


def split(manifest: Manifest, payload: np.ndarray, held: int, sizes: dict[str, int]) -> Parts:
    """``payload`` (uint8, ``manifest.total`` bytes) by tensor, checked against the receiver's state of
    version ``held`` (``sizes``: its elements per tensor). Raises WrongBase for a delta against another
    version or a tensor the receiver does not hold, ValueError for a payload that does not fit."""
    check_base(manifest, held)
    if payload.dtype != np.uint8 or payload.size != manifest.total:
        raise ValueError(f"payload of {payload.size} bytes for a manifest of {manifest.total}")
    parts = Parts({}, {})
    for spec, at in zip(manifest.tensors, manifest.offsets(), strict=True):
        piece = payload[at:at + spec.nbytes]
        if spec.encoding == Encoding.DENSE:
            parts.dense[spec.name] = piece.view(_BITS[ITEMSIZE[spec.dtype]]).reshape(spec.shape)
        else:
            parts.deltas[spec.name] = delta_of(spec, piece, sizes)
    return parts


def decode(manifest: Manifest, payload: np.ndarray, held: int, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The new tensors (bits, shaped) of ``manifest`` from ``payload``, deltas applied to copies of
    ``state`` (the receiver's bits of version ``held``; never changed here). Raises as :func:`split`."""
    parts = split(manifest, payload, held, {k: v.size for k, v in state.items()})
    out = {}
    for spec in manifest.tensors:
        if spec.name in parts.dense:
            out[spec.name] = parts.dense[spec.name]
            continue
        idx, values = parts.deltas[spec.name]
        new = state[spec.name].reshape(-1).copy()
        new[idx] = values
        out[spec.name] = new.reshape(state[spec.name].shape)
    return out
