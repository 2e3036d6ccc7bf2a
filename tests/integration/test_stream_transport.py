"""A streamed update's chain over gloo between real processes on 127.0.0.1 (``toolkit/weights/
transport.py``): the trainer (this process) and two receivers, dense then delta, every tensor arriving
exact at both; a receiver that dies mid-update breaks the link at once for the others, and the trainer's
next group works."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pytest

pytest.importorskip("torch")

from toolkit.weights.transport import Link, LinkBroken  # noqa: E402
from toolkit.weights.wire import Encoder, Encoding  # noqa: E402


def model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {f"layers.{i}.weight": rng.integers(0, 2**16, (512, 1024), dtype=np.uint16) for i in range(3)}


def receivers(tmp: Path, port: int, world: int, manifests: list[Path], die_after: int = -1) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-m", "tests.helpers.stream_ranks", "--port", str(port), "--rank", str(r),
                              "--world", str(world), "--manifests", *map(str, manifests),
                              *(["--die-after", str(die_after)] if r == world - 1 else [])],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(1, world)]


def write(tmp: Path, name: str, update) -> Path:  # noqa: ANN001
    path = tmp / name
    path.write_bytes(msgspec.msgpack.encode(update.manifest))
    return path


def crcs(m: dict[str, np.ndarray]) -> dict[str, int]:
    return {k: zlib.crc32(v.tobytes()) for k, v in m.items()}


@pytest.mark.timeout(120)
def test_a_dense_and_a_delta_update_reach_both_receivers_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    m1 = model(rng)
    enc = Encoder(bucket_bytes=256 << 10)  # 12 buckets for 3 MiB: the chain pipelines
    u1 = enc.encode(1, [(k, v, "bfloat16") for k, v in m1.items()], delta=True)
    enc.commit()
    m2 = {k: v.copy() for k, v in m1.items()}
    for v in m2.values():
        flat = v.reshape(-1)
        flat[rng.choice(flat.size, flat.size // 100, replace=False)] += 1  # 1% of the elements
    u2 = enc.encode(2, [(k, v, "bfloat16") for k, v in m2.items()], delta=True)
    assert all(t.encoding == Encoding.DELTA for t in u2.manifest.tensors)
    assert u2.manifest.total / u2.manifest.dense_bytes == pytest.approx(0.03, rel=0.02)
    store, port = Link.rendezvous("127.0.0.1", 3, 30)
    procs = receivers(tmp_path, port, 3, [write(tmp_path, "m1", u1), write(tmp_path, "m2", u2)])
    try:
        link = Link("127.0.0.1", port, 0, 3, timeout_s=30, store=store)
        link.send(u1.manifest, u1.pieces)
        link.send(u2.manifest, u2.pieces)
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for (out, err), p in zip(outs, procs, strict=True):
        lines = [json.loads(line) for line in out.splitlines()]
        assert p.returncode == 0 and [line.get("version") for line in lines] == [1, 2], (out, err[-2000:])
        assert lines[0]["crc"] == crcs(m1) and lines[1]["crc"] == crcs(m2)


@pytest.mark.timeout(120)
def test_a_receiver_dying_mid_update_breaks_the_link_and_the_next_group_works(tmp_path: Path) -> None:
    m = model(np.random.default_rng(1))
    enc = Encoder(bucket_bytes=128 << 10)
    u = enc.encode(1, [(k, v, "bfloat16") for k, v in m.items()], delta=False)
    path = write(tmp_path, "m1", u)
    store, port = Link.rendezvous("127.0.0.1", 3, 30)
    procs = receivers(tmp_path, port, 3, [path], die_after=1 << 20)  # the last rank dies after 1 MiB
    try:
        link = Link("127.0.0.1", port, 0, 3, timeout_s=30, store=store)
        with pytest.raises(LinkBroken):
            link.send(u.manifest, u.pieces)  # rank 1 cannot forward: it stops taking buckets
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == 17
    assert "LinkBroken" in json.loads(outs[0][0].splitlines()[-1])["error"], outs[0]
    # The trainer's next update, on a new group without the dead rank, lands.
    store, port = Link.rendezvous("127.0.0.1", 2, 30)
    procs = receivers(tmp_path, port, 2, [path])
    try:
        Link("127.0.0.1", port, 0, 2, timeout_s=30, store=store).send(u.manifest, u.pieces)
        out, err = procs[0].communicate(timeout=60)
    finally:
        procs[0].kill()
    assert json.loads(out.splitlines()[-1])["crc"] == crcs(m), err[-2000:]


@pytest.mark.timeout(60)
def test_a_trainer_gone_before_the_receiver_posts_its_receives_is_a_broken_link(tmp_path: Path) -> None:
    """gloo refuses to post a receive on a pair whose peer has closed (not only to wait on one): the
    receiver gets ``LinkBroken`` either way, never gloo's bare RuntimeError."""
    u = Encoder(bucket_bytes=64 << 10).encode(1, [("w", np.arange(1 << 20, dtype=np.uint16), "bfloat16")], delta=False)
    store, port = Link.rendezvous("127.0.0.1", 2, 30)
    joined, gone = threading.Event(), threading.Event()
    raised: list[BaseException] = []

    def receiver() -> None:
        link = Link("127.0.0.1", port, 1, 2, timeout_s=30)
        joined.set()
        gone.wait(30)
        try:
            link.receive(u.manifest, np.empty(u.manifest.total, np.uint8))
        except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
            raised.append(exc)

    t = threading.Thread(target=receiver)
    t.start()
    trainer = Link("127.0.0.1", port, 0, 2, timeout_s=30, store=store)
    # Both ends have joined: the trainer's end returns as soon as its own pairs connect, which can be
    # before the receiver's do (and a receiver whose trainer leaves then fails to join, as LinkBroken too).
    assert joined.wait(30)
    trainer.close()
    del trainer
    gc.collect()
    gone.set()
    t.join(30)
    assert len(raised) == 1 and isinstance(raised[0], LinkBroken), raised
    assert "rank 1 of 2: receiving bucket 0" in str(raised[0])


@pytest.mark.timeout(120)
def test_a_replica_of_two_workers_is_one_hop_and_each_worker_gets_exactly_its_share(tmp_path: Path) -> None:
    """The trainer sends to a replica's first worker only; it passes the other worker that worker's share of
    each bucket (the regions it was sent first), and keeps its own: each ends with exactly its regions of the
    dense update and every delta whole. Many buckets hold none of one worker's share (the halves of
    column-parallel tensors), so a worker's sends skip buckets."""
    from toolkit.weights.shards import Region

    rng = np.random.default_rng(3)
    m1 = model(rng)  # three (512, 1024) tensors: 1 MiB each in bf16
    half = 256 * 1024
    regions = [{"layers.0.weight": [0, 1, half, half], "layers.1.weight": [0, 512, 512, 1024]},  # rows; columns
               {"layers.0.weight": [half, 1, half, half], "layers.1.weight": [512, 512, 512, 1024]}]  # the third whole
    np.savez(tmp_path / "held.npz", **m1)
    enc = Encoder(bucket_bytes=64 << 10)
    enc.encode(1, [(k, v, "bfloat16") for k, v in m1.items()], delta=False)
    enc.commit()
    m2 = {k: v + np.uint16(1) for k, v in m1.items()}  # every element: dense
    u2 = enc.encode(2, [(k, v, "bfloat16") for k, v in m2.items()], delta=True)
    enc.commit()
    m3 = {k: v.copy() for k, v in m2.items()}
    for v in m3.values():
        flat = v.reshape(-1)
        flat[rng.choice(flat.size, flat.size // 100, replace=False)] += 1
    u3 = enc.encode(3, [(k, v, "bfloat16") for k, v in m3.items()], delta=True)
    assert all(t.encoding == Encoding.DELTA for t in u3.manifest.tensors)
    paths = [write(tmp_path, "m2", u2), write(tmp_path, "m3", u3)]
    rendezvous = [Link.rendezvous("127.0.0.1", 3, 30) for _ in range(2)]  # one per update, as the Streamer's
    ports = [str(port) for _, port in rendezvous]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.stream_workers", "--ports", *ports, "--index",
                               str(i), "--regions", json.dumps(regions[i]), "--held", str(tmp_path / "held.npz"),
                               "--manifests", *map(str, paths)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        for (store, port), u in zip(rendezvous, (u2, u3), strict=True):
            Link("127.0.0.1", port, 0, 3, timeout_s=30, store=store).send(u.manifest, u.pieces)
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    deltas = dict(zip([t.name for t in u3.manifest.tensors],
                      [zlib.crc32(u3.pieces[2 * k].tobytes() + u3.pieces[2 * k + 1].tobytes()) for k in range(3)],
                      strict=True))
    for i, (out, err) in enumerate(outs):
        lines = [json.loads(line) for line in out.splitlines()]
        assert [line.get("version") for line in lines] == [2, 3], (out, err[-2000:])
        want = {}
        for name, v in m2.items():
            r = Region(*regions[i][name]) if name in regions[i] else Region.whole(v.size)
            got = np.empty(r.numel, np.uint16)
            r.gather(v.reshape(-1), got)
            want[name] = zlib.crc32(got.tobytes())
        assert lines[0]["crc"] == want and lines[0]["kept"] == 2 * half * 2 + 512 * 1024 * 2
        assert lines[1]["crc"] == deltas and lines[1]["kept"] == u3.manifest.total


@pytest.mark.timeout(120)
def test_the_weights_benchmarks_link_bound_delivers_every_rounds_bytes() -> None:
    """``bench weights``' bound: each round's value reaches both receivers (which check it and fail
    the bound if not), into buffers kept from round to round."""
    from toolkit.bench.weights_trainer import link_bound

    times = link_bound(3 << 20, 3)
    assert len(times) == 3 and all(t > 0 for t in times)
