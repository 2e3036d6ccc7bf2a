"""A streamed update's manifest and payload (``toolkit/weights/wire.py``): dense and delta round trips,
the delta's size after a small change, a wrong base refused, buckets, and the manifest on the wire; and
what a process without torch is told when it streams (``toolkit/weights/transport.py``)."""

from __future__ import annotations

import sys

import msgspec
import numpy as np
import pytest

from toolkit.core.errors import ToolkitError
from toolkit.weights.transport import require_torch
from toolkit.weights.wire import Encoder, Encoding, Manifest, WrongBase, bucket_ranges, decode


def model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"embed.weight": rng.integers(0, 2**16, (64, 32), dtype=np.uint16),  # bf16 bits
            "layers.0.mlp.weight": rng.integers(0, 2**16, (32, 96), dtype=np.uint16),
            "norm.weight": rng.standard_normal(32).astype(np.float32)}


def named(m: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray, str]]:
    return [(k, v, "float32" if v.dtype == np.float32 else "bfloat16") for k, v in m.items()]


def payload(update) -> np.ndarray:  # noqa: ANN001
    return np.concatenate(update.pieces) if update.pieces else np.zeros(0, np.uint8)


def same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k


def test_a_dense_then_a_delta_update_rebuild_the_trainers_tensors() -> None:
    rng = np.random.default_rng(0)
    m = model(rng)
    enc = Encoder(bucket_bytes=1000)
    first = enc.encode(1, named(m), delta=True)  # nothing sent yet: dense
    assert first.manifest.base == -1 and all(t.encoding == Encoding.DENSE for t in first.manifest.tensors)
    assert first.manifest.total == first.manifest.dense_bytes == 64 * 32 * 2 + 32 * 96 * 2 + 32 * 4
    held = decode(first.manifest, payload(first), held=0, state={})
    same(held, m)
    enc.commit()

    m2 = {k: v.copy() for k, v in m.items()}
    m2["embed.weight"].reshape(-1)[rng.choice(m2["embed.weight"].size, 20, replace=False)] ^= 1
    m2["layers.0.mlp.weight"] = rng.integers(0, 2**16, (32, 96), dtype=np.uint16)  # all changed: dense
    second = enc.encode(2, named(m2), delta=True)
    kinds = {t.name: (t.encoding, t.nnz) for t in second.manifest.tensors}
    assert kinds["embed.weight"] == (Encoding.DELTA, 20)
    assert kinds["layers.0.mlp.weight"][0] == Encoding.DENSE
    assert kinds["norm.weight"] == (Encoding.DELTA, 0)  # unchanged: no bytes at all
    assert second.manifest.base == 1
    assert second.manifest.total == 20 * (4 + 2) + 32 * 96 * 2
    before = {k: v.copy() for k, v in held.items()}
    new = decode(second.manifest, payload(second), held=1, state=held)
    same(new, m2)
    same(held, before)  # the receiver's state is never changed in place


def test_a_delta_is_refused_against_another_base_and_an_uncommitted_update_is_no_base() -> None:
    rng = np.random.default_rng(1)
    m = model(rng)
    enc = Encoder(bucket_bytes=4096)
    held = decode((u := enc.encode(1, named(m), delta=True)).manifest, payload(u), 0, {})
    enc.commit()
    m["norm.weight"][0] += 1
    lost = enc.encode(2, named(m), delta=True)  # never reached the replicas: not committed
    m["norm.weight"][1] += 1
    third = enc.encode(3, named(m), delta=True)
    assert third.manifest.base == 1  # against what was committed, not the lost update
    with pytest.raises(WrongBase, match="delta against version 1, but this replica holds version 2"):
        decode(third.manifest, payload(third), held=2, state=held)
    same(decode(third.manifest, payload(third), held=1, state=held), m)
    assert lost.manifest.base == 1
    # What a replica that missed versions gets: the committed state, dense, for any version it holds.
    enc.commit()
    dense = enc.dense()
    assert dense.manifest.base == -1 and dense.manifest.version == 3
    same(decode(dense.manifest, payload(dense), held=0, state={}), m)


def test_bad_updates_name_what_is_wrong() -> None:
    rng = np.random.default_rng(2)
    m = model(rng)
    enc = Encoder(bucket_bytes=64)
    u = enc.encode(1, named(m), delta=False)
    enc.commit()
    with pytest.raises(ValueError, match="missing: \\['norm.weight'\\]"):
        enc.encode(2, named(m)[:2], delta=True)
    with pytest.raises(ValueError, match="given twice"):
        enc.encode(2, named(m) + named(m)[:1], delta=True)
    with pytest.raises(ValueError, match="cannot be streamed; valid: bfloat16"):
        enc.encode(2, [("x", np.zeros(3, np.float32), "complex64")], delta=False)
    with pytest.raises(ValueError, match="holds no bfloat16 elements"):
        enc.encode(2, [("x", np.zeros(3, np.float32), "bfloat16")], delta=False)
    with pytest.raises(ValueError, match="payload of 3 bytes"):
        decode(u.manifest, np.zeros(3, np.uint8), 0, {})


def test_buckets_cover_the_payload_and_the_manifest_crosses_the_wire() -> None:
    assert bucket_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert bucket_ranges(8, 4) == [(0, 4), (4, 8)] and bucket_ranges(0, 4) == []
    with pytest.raises(ValueError):
        bucket_ranges(10, 0)
    enc = Encoder(bucket_bytes=1 << 20)
    u = enc.encode(7, named(model(np.random.default_rng(3))), delta=True)
    wire = msgspec.msgpack.encode(u.manifest)
    back = msgspec.msgpack.Decoder(Manifest).decode(wire)
    assert back == u.manifest and back.buckets() == [(0, u.manifest.total)]


def test_without_torch_a_stream_fails_saying_what_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # (how an import of a package that is not installed fails)
    with pytest.raises(ToolkitError, match="streamed weights need torch.*weights_transport=checkpoint"):
        require_torch()


def test_a_tensor_too_large_for_a_deltas_indices_goes_dense(monkeypatch: pytest.MonkeyPatch) -> None:
    """Indices are int32: past 2**31 elements they would wrap (refused or, past 2**32, wrong places)."""
    from toolkit.weights import wire

    monkeypatch.setattr(wire, "MAX_DELTA_NUMEL", 64 * 32 - 1)  # embed.weight is 2,048 elements
    m = model(np.random.default_rng(1))
    enc = Encoder(bucket_bytes=4096)
    enc.encode(1, named(m), delta=True)
    enc.commit()
    m["embed.weight"].reshape(-1)[:3] ^= 1
    kinds = {t.name: t.encoding for t in enc.encode(2, named(m), delta=True).manifest.tensors}
    assert kinds["embed.weight"] == Encoding.DENSE and kinds["norm.weight"] == Encoding.DELTA


def test_a_dense_update_that_leaves_tensors_out_loads_them_as_held_and_nothing_staged_rolls_back() -> None:
    """vLLM's layerwise reload loads a layer's every parameter: one the update does not name keeps its
    held value instead of the memory the reload allocated. Applying with nothing staged changes nothing
    (the previous version serves: ``rolled_back``, not a broken engine)."""
    pytest.importorskip("torch")
    from toolkit.engine.vllm_receiver import Receiver
    from toolkit.weights.shards import Region, Slot

    m = model(np.random.default_rng(2))
    rx = Receiver()
    rx.held = {k: Slot(Region.whole(v.size), v.shape, d, whole=v.reshape(-1).copy()) for k, v, d in named(m)}
    rx.version = 1
    loaded: list[str] = []
    rx._load = lambda model, config, tensors: loaded.extend(name for name, _ in tensors)  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="nothing staged"):
        rx.apply(None, None)
    assert rx.status["state"] == "rolled_back" and rx.version == 1
    enc = Encoder(bucket_bytes=1 << 20)
    part = [x for x in named(m) if x[0] == "norm.weight"]
    up = enc.encode(2, part, delta=False)
    from toolkit.weights.wire import split

    rx._staged = (up.manifest, split(up.manifest, payload(up), held=1, sizes={}))
    rx.apply(None, None)
    assert loaded == ["norm.weight", "embed.weight", "layers.0.mlp.weight"] and rx.version == 2
