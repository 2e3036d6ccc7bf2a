"""A worker's share of a streamed update (``toolkit/weights/shards.py``): the regions a narrow reads, kept
compact, read back through a full-shaped view, cut out of buckets as they pass, and deltas mapped onto them."""

from __future__ import annotations

import numpy as np
import pytest

from toolkit.weights.shards import Keep, Region, Share, Slot
from toolkit.weights.wire import Encoder, Encoding, Manifest, TensorSpec, WrongBase, bits, bucket_ranges

pytestmark = pytest.mark.unit


def _narrow(shape: tuple[int, ...], dim: int, start: int, size: int) -> tuple[slice, ...]:
    return tuple(slice(start, start + size) if k == dim else slice(None) for k in range(len(shape)))


def _region_of(full: np.ndarray, view: np.ndarray) -> Region | None:
    w = full.itemsize
    offset = (view.__array_interface__["data"][0] - full.__array_interface__["data"][0]) // w
    return Region.of_view(view.shape, tuple(s // w for s in view.strides), offset, full.shape)


CASES = [((8, 6), 0, 2, 4), ((8, 6), 1, 3, 3), ((8, 6), 1, 0, 2), ((12,), 0, 4, 4), ((4, 6, 5), 1, 2, 3),
         ((4, 6, 5), 2, 1, 3), ((4, 6, 5), 0, 1, 2), ((5, 7), 0, 0, 5), ((5, 7), 1, 6, 1)]


@pytest.mark.parametrize(("shape", "dim", "start", "size"), CASES)
def test_a_narrow_read_through_the_compact_copys_full_view_is_the_narrow_of_the_whole(
        shape: tuple[int, ...], dim: int, start: int, size: int) -> None:
    rng = np.random.default_rng(1)
    full = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    cut = _narrow(shape, dim, start, size)
    region = _region_of(full, full[cut])
    assert region is not None and region.numel == full[cut].size
    slot = Slot(region, shape, "bfloat16")
    region.gather(full.reshape(-1), slot.bits)
    assert np.array_equal(slot.full()[cut], full[cut])
    if region.numel < full.size:  # only the region's own pages are written: the rest stays zero
        assert np.count_nonzero(slot.memory) <= region.numel * 2


def test_views_that_no_full_shaped_view_can_read_are_not_regions() -> None:
    full = np.zeros((4, 6, 5), np.uint16)
    assert _region_of(full, full[1:3, 2:4]) == Region(40, 2, 10, 30)  # rows of 10 in rows of 30
    assert _region_of(full, full[1:3, 2:4, 1:3]) is None  # runs within rows within rows
    assert Region.of_view((3,), (2,), 0, (6,)) is None  # a strided gather
    empty = Region.of_view((0, 4), (4, 1), 0, (3, 4))
    assert empty is not None and empty.numel == 0


@pytest.mark.parametrize(("shape", "dim", "start", "size"), CASES)
def test_buckets_cut_at_any_byte_keep_exactly_the_region(shape: tuple[int, ...], dim: int, start: int,
                                                         size: int) -> None:
    rng = np.random.default_rng(2)
    full = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    region = _region_of(full, full[_narrow(shape, dim, start, size)])
    assert region is not None
    want = np.empty(region.numel, np.uint16)
    region.gather(full.reshape(-1), want)
    raw = full.reshape(-1).view(np.uint8)
    for bucket in (1, 3, 7, 16, 1000):
        got = np.zeros(region.numel, np.uint16)
        for s, e in bucket_ranges(raw.size, bucket):
            region.take(raw[s:e], s, got.view(np.uint8), 2)
        assert np.array_equal(got, want), bucket


def test_deltas_map_onto_the_compact_copy_and_skip_what_is_not_the_workers() -> None:
    region = Region(offset=3, rows=8, cols=3, stride=6)  # columns 3..5 of an (8, 6) tensor
    idx = np.array([0, 3, 5, 6, 9, 47, 44], np.int32)
    inside, pos = region.local(idx)
    assert inside.tolist() == [False, True, True, False, True, True, False]
    assert pos.tolist() == [0, 2, 3, 23]


def test_a_worker_keeps_its_regions_of_dense_tensors_and_every_delta_whole() -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 8)).astype(np.float32)
    b = rng.standard_normal((8, 16)).astype(np.float32)
    enc = Encoder(bucket_bytes=100)
    first = enc.encode(1, [("a", a, "float32"), ("b", b, "float32")], delta=False)
    enc.commit()
    regions = {"a": Region(offset=64, rows=1, cols=64, stride=64), "b": Region(offset=8, rows=8, cols=8, stride=16)}
    keep = Keep(first.manifest, regions, {})
    payload = np.concatenate(first.pieces)
    for s, e in first.manifest.buckets():
        keep.take(payload[s:e], s)
    assert keep.kept_bytes == 64 * 4 + 64 * 4
    parts = keep.parts(held=-1, sizes={})
    assert np.array_equal(parts.dense["a"], bits(a, "float32").reshape(-1)[64:])
    assert np.array_equal(parts.dense["b"], bits(b, "float32")[:, 8:].reshape(-1))
    slots = keep.slots
    b2 = b.copy()
    b2[0, 0] += 1  # outside the worker's columns
    b2[7, 15] += 1  # inside
    second = enc.encode(2, [("a", a, "float32"), ("b", b2, "float32")], delta=True)
    keep = Keep(second.manifest, regions, slots)
    assert keep.slots["a"] is slots["a"]  # reused
    payload = np.concatenate(second.pieces)
    for s, e in second.manifest.buckets():
        keep.take(payload[s:e], s)
    with pytest.raises(WrongBase):
        keep.parts(held=0, sizes={"a": 128, "b": 128})
    parts = keep.parts(held=1, sizes={"a": 128, "b": 128})
    idx, values = parts.deltas["b"]
    assert sorted(idx.tolist()) == [0, 127]
    inside, pos = regions["b"].local(idx)
    assert pos.tolist() == [63] and values[inside].view(np.float32).tolist() == [b2[7, 15]]


def test_an_empty_manifest_keeps_nothing() -> None:
    keep = Keep(Manifest(1, -1, (TensorSpec("x", "bfloat16", (0,)),), 16), {}, {})
    assert keep.kept_bytes == 0 and keep.parts(-1, {}).dense["x"].size == 0


def test_a_workers_bytes_cut_out_by_another_and_placed_equal_what_it_keeps_itself() -> None:
    """The head of a replica cuts each bucket's bytes of a sibling (``Share.extract``), the sibling places
    them (``Keep.place``): the sibling ends with what it would have kept from the whole buckets."""
    rng = np.random.default_rng(4)
    tensors = [("col", rng.standard_normal((12, 10)).astype(np.float32)),
               ("row", rng.standard_normal((10, 12)).astype(np.float32)),
               ("norm", rng.standard_normal(10).astype(np.float32))]
    enc = Encoder(bucket_bytes=1)
    enc.encode(1, [(n, a, "float32") for n, a in tensors], delta=False)
    enc.commit()
    changed = [(n, a + (np.arange(a.size).reshape(a.shape) % 7 == 0), "float32") for n, a in tensors]
    regions = {"col": Region(60, 6, 10, 10), "row": Region(6, 10, 6, 12)}
    for delta in (False, True):
        for bucket in (5, 64, 333, 4096):
            u = enc.encode(2, changed, delta=delta)
            manifest = Manifest(u.manifest.version, u.manifest.base, u.manifest.tensors, bucket)
            payload = np.concatenate(u.pieces)
            whole, cut = Keep(manifest, regions, {}), Keep(manifest, regions, {})
            share = Share(manifest, regions)
            for s, e in manifest.buckets():
                whole.take(payload[s:e], s)
                out = np.full(e - s, 255, np.uint8)
                n = share.extract(payload[s:e], s, out)
                assert n == share.size(s, e)
                cut.place(out[:n], s, e)
            assert sum(share.size(s, e) for s, e in manifest.buckets()) == whole.kept_bytes
            for a, b in zip(whole.targets, cut.targets, strict=True):
                assert np.array_equal(a, b), (delta, bucket)
            assert any(t.encoding == Encoding.DELTA for t in manifest.tensors) == delta
