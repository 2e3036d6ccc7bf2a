"""A worker's share of a streamed update: the elements of each tensor its own weight loaders read, kept
compact, and the bytes passing through it on the chain cut down to them as they come.

A tensor-parallel worker's loader reads one narrow of each checkpoint tensor (a column-parallel shard is
a run of whole rows, a row-parallel shard the same columns of every row; a pipeline stage reads nothing
of another stage's layers). A :class:`Region` names those elements; a :class:`Slot` keeps just them, in a
memory map whose untouched pages cost nothing, laid out so that a full-shaped strided view of it reads
right at the region: the engine's loaders cut the shard from that view as from the whole tensor.
"""

from __future__ import annotations

import bisect
import mmap
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import as_strided

from toolkit.weights.wire import _BITS, ITEMSIZE, Encoding, Manifest, Parts, check_base, delta_of


@dataclass(frozen=True)
class Region:
    """Elements ``offset + r * stride + c`` (``r < rows``, ``c < cols``) of a tensor's flat elements."""

    offset: int
    rows: int
    cols: int
    stride: int

    @classmethod
    def whole(cls, numel: int) -> Region:
        return cls(0, 1, numel, max(1, numel))

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @classmethod
    def of_view(cls, shape: tuple[int, ...], strides: tuple[int, ...], offset: int,
                full: tuple[int, ...]) -> Region | None:
        """The elements a view (``shape``, ``strides``, ``offset``) of a contiguous tensor of shape
        ``full`` reads, if they are a region a full-shaped view can be laid over (else None)."""
        if 0 in shape:
            return cls(0, 0, 0, 1)
        merged: list[tuple[int, int]] = []  # (stride, size), outermost first
        for st, n in sorted(((st, n) for n, st in zip(shape, strides, strict=True) if n != 1), reverse=True):
            if merged and merged[-1][0] == st * n:
                merged[-1] = (st, merged[-1][1] * n)
            else:
                merged.append((st, n))
        if not merged:
            region = cls(offset, 1, 1, 1)
        elif len(merged) == 1:
            st, n = merged[0]
            region = cls(offset, 1, n, n) if st == 1 else cls(offset, n, 1, st)
        elif len(merged) == 2 and merged[1][0] == 1 and merged[0][0] >= merged[1][1]:
            region = cls(offset, merged[0][1], merged[1][1], merged[0][0])
        else:
            return None
        return region if region.layout(full) is not None else None

    def layout(self, full: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]] | None:
        """How a full-shaped view (offset 0) reads this region from a compact copy: (elements before the
        copy, elements in all, the view's strides), or None when no such view can (the region runs past
        the tensor, or its rows are not whole rows of the tensor's trailing dims)."""
        total = int(np.prod(full, dtype=np.int64))
        contiguous = tuple(int(np.prod(full[k + 1:], dtype=np.int64)) for k in range(len(full)))
        if self.numel == 0:
            return 0, 1, tuple(0 for _ in full)
        if self.offset < 0 or self.offset + (self.rows - 1) * self.stride + self.cols > total:
            return None
        if self.rows == 1 or self.cols == self.stride:
            return self.offset, total, contiguous
        m = next((k for k in range(1, len(full)) if contiguous[k - 1] == self.stride), None)
        r0, c0 = divmod(self.offset, self.stride)
        if m is None or c0 + self.cols > self.stride:
            return None
        strides = tuple(s // self.stride * self.cols if k < m else s for k, s in enumerate(contiguous))
        return r0 * self.cols + c0, (total // self.stride - 1) * self.cols + self.stride, strides

    def gather(self, flat: np.ndarray, out: np.ndarray) -> None:
        """This region's elements of ``flat`` (a whole tensor's, flat) into ``out`` (compact)."""
        if self.numel:
            out.reshape(self.rows, self.cols)[...] = as_strided(
                flat[self.offset:], (self.rows, self.cols), (self.stride * flat.itemsize, flat.itemsize))

    def local(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of flat indices ``idx`` of the whole tensor: which fall in the region (a mask), and their
        positions in the compact copy."""
        d = idx.astype(np.int64) - self.offset
        if self.rows == 1:  # one run (a whole tensor): no division
            inside = (d >= 0) & (d < self.cols)
            return inside, d[inside]
        r, c = np.divmod(d, self.stride)
        inside = (d >= 0) & (r < self.rows) & (c < self.cols)
        return inside, (r[inside] * self.cols + c[inside])

    def kept(self, x: int, width: int) -> int:
        """The region's bytes among the tensor's first ``x`` bytes (``width``: bytes per element)."""
        o, w, s = self.offset * width, self.cols * width, self.stride * width
        if not self.numel or x <= o:
            return 0
        r, into = divmod(x - o, s)
        return self.numel * width if r >= self.rows else r * w + min(into, w)

    def take(self, src: np.ndarray, at: int, dst: np.ndarray, width: int, skip: int = 0) -> None:
        """Copy the region's bytes among ``src`` (uint8: the tensor's bytes from byte ``at``) to their
        places in ``dst`` (uint8: the compact copy's bytes, its first ``skip`` left out); ``width``:
        bytes per element."""
        if not self.numel or not src.size:
            return
        o, w, s = self.offset * width, self.cols * width, self.stride * width
        end = at + src.size
        if end <= o:
            return
        first = max(0, (at - o) // s)
        last = min(self.rows, (end - 1 - o) // s + 1)  # rows first..last-1 meet [at, end)
        bulk_a = max(first, -(-(at - o) // s))
        bulk_b = min(last, (end - o - w) // s + 1) if end - o >= w else first
        if bulk_a < bulk_b:
            n = bulk_b - bulk_a
            dst[bulk_a * w - skip:bulk_b * w - skip].reshape(n, w)[...] = as_strided(src[o + bulk_a * s - at:], (n, w),
                                                                                     (s, 1))
        else:
            bulk_a = bulk_b = last
        for r in {first, last - 1} - set(range(bulk_a, bulk_b)):
            if first <= r < last:
                lo, hi = max(at, o + r * s), min(end, o + r * s + w)
                if lo < hi:
                    dst[r * w + lo - o - r * s - skip:r * w + hi - o - r * s - skip] = src[lo - at:hi - at]


def arena(nbytes: int) -> np.ndarray:
    """``nbytes`` of anonymous memory (uint8) whose pages cost nothing until written (no huge pages: one
    written byte would make two megabytes resident)."""
    m = mmap.mmap(-1, max(1, nbytes))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        m.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(m, np.uint8)[:nbytes]


class Slot:
    """One tensor's region, kept compact (``bits``), with the room around it a full-shaped view needs."""

    def __init__(self, region: Region, shape: tuple[int, ...], dtype: str, whole: np.ndarray | None = None) -> None:
        """``whole``: a whole tensor's bits (C-contiguous) to keep as they are, when ``region`` is all of it
        (no copy)."""
        layout = region.layout(shape)
        if layout is None:
            raise ValueError(f"region {region} cannot be read by a view of shape {shape}")
        self.region, self.shape, self.dtype = region, shape, dtype
        self.pre, span, self.strides = layout
        width = ITEMSIZE[dtype]
        if whole is not None and self.pre == 0 and span == region.numel == whole.size and whole.flags.c_contiguous:
            self.memory = whole.reshape(-1).view(np.uint8)
        else:
            self.memory = arena(span * width)
        self.bits = self.memory[self.pre * width:(self.pre + region.numel) * width].view(_BITS[width])
        """The region's elements (their bits), in order: the only pages ever written."""

    def fits(self, region: Region, shape: tuple[int, ...], dtype: str) -> bool:
        return (region, shape, dtype) == (self.region, self.shape, self.dtype)

    def full(self) -> np.ndarray:
        """A full-shaped view of the tensor's bits that is right at the region (elsewhere it reads other
        elements or untouched memory: the loader this region was found from never reads there)."""
        width = ITEMSIZE[self.dtype]
        return as_strided(self.memory.view(_BITS[width]), self.shape, tuple(s * width for s in self.strides))


class Share:
    """What one worker keeps of an update's payload, byte by byte: of each dense tensor its region (the
    whole tensor where ``regions`` names none), every delta whole (its indices span the whole tensor).
    The kept bytes, in payload order, are the worker's part of each bucket."""

    def __init__(self, manifest: Manifest, regions: dict[str, Region]) -> None:
        self.manifest = manifest
        self.starts = manifest.offsets()
        self.parts: list[tuple[Region, int]] = []
        """Per tensor: the region of its payload bytes kept, and the element width it is in."""
        for spec in manifest.tensors:
            if spec.encoding == Encoding.DELTA:
                self.parts.append((Region.whole(spec.nbytes), 1))
            else:
                self.parts.append((regions.get(spec.name) or Region.whole(spec.numel), ITEMSIZE[spec.dtype]))

    def meeting(self, s: int, e: int) -> Iterator[tuple[int, int, int, int, Region, int]]:
        """For each tensor the payload's bytes ``s .. e`` meet: its index, its first byte, the range within
        it (lo, hi), and its kept region and width."""
        k = max(0, bisect.bisect_right(self.starts, s) - 1)
        for i in range(k, len(self.starts)):
            at = self.starts[i]
            if at >= e:
                break
            spec = self.manifest.tensors[i]
            lo, hi = max(s, at) - at, min(e, at + spec.nbytes) - at
            if lo < hi:
                region, width = self.parts[i]
                yield i, at, lo, hi, region, width

    def size(self, s: int, e: int) -> int:
        """Kept bytes among the payload's bytes ``s .. e``."""
        return sum(region.kept(hi, width) - region.kept(lo, width)
                   for _, _, lo, hi, region, width in self.meeting(s, e))

    def extract(self, bucket: np.ndarray, s: int, out: np.ndarray) -> int:
        """The kept bytes of the payload's bytes ``s .. s + len(bucket)`` (``bucket``), in order, into
        ``out``; how many."""
        n = 0
        for _, at, lo, hi, region, width in self.meeting(s, s + bucket.size):
            skip = region.kept(lo, width)
            region.take(bucket[at + lo - s:at + hi - s], lo, out[n:], width, skip)
            n += region.kept(hi, width) - skip
        return n


class Keep:
    """A worker's :class:`Share` of an update, kept: each dense tensor's region into a :class:`Slot`
    (reused from ``slots`` where it fits), every delta whole into one buffer."""

    def __init__(self, manifest: Manifest, regions: dict[str, Region], slots: dict[str, Slot]) -> None:
        self.share = Share(manifest, regions)
        self.manifest, self.slots = manifest, slots
        self.targets: list[np.ndarray] = []
        self.deltas = np.empty(sum(t.nbytes for t in manifest.tensors if t.encoding == Encoding.DELTA), np.uint8)
        at = 0
        for spec, (region, _) in zip(manifest.tensors, self.share.parts, strict=True):
            if spec.encoding == Encoding.DELTA:
                self.targets.append(self.deltas[at:at + spec.nbytes])
                at += spec.nbytes
                continue
            slot = slots.get(spec.name)
            if slot is None or not slot.fits(region, spec.shape, spec.dtype):
                slot = slots[spec.name] = Slot(region, spec.shape, spec.dtype)
            self.targets.append(slot.bits.view(np.uint8))

    @property
    def kept_bytes(self) -> int:
        return sum(t.size for t in self.targets)

    def take(self, bucket: np.ndarray, s: int) -> None:
        """The payload's bytes ``s .. s + len(bucket)`` (``bucket``) arrived: keep this worker's."""
        for i, at, lo, hi, region, width in self.share.meeting(s, s + bucket.size):
            region.take(bucket[at + lo - s:at + hi - s], lo, self.targets[i], width)

    def place(self, part: np.ndarray, s: int, e: int) -> None:
        """This worker's bytes of the payload's bytes ``s .. e`` arrived on their own (``part``, as
        :meth:`Share.extract` cut them): each tensor's piece to its place."""
        n = 0
        for i, _, lo, hi, region, width in self.share.meeting(s, e):
            a, b = region.kept(lo, width), region.kept(hi, width)
            self.targets[i][a:b] = part[n:n + b - a]
            n += b - a

    def parts(self, held: int, sizes: dict[str, int]) -> Parts:
        """The kept update by tensor (dense: the slots' bits; deltas: indices over the whole tensor and
        values), checked as :func:`~toolkit.weights.wire.split` does."""
        check_base(self.manifest, held)
        parts = Parts({}, {})
        for spec, dst in zip(self.manifest.tensors, self.targets, strict=True):
            if spec.encoding == Encoding.DENSE:
                parts.dense[spec.name] = self.slots[spec.name].bits
            else:
                parts.deltas[spec.name] = delta_of(spec, dst, sizes)
        return parts
