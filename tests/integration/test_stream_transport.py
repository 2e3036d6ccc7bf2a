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
    gone = threading.Event()
    raised: list[BaseException] = []

    def receiver() -> None:
        link = Link("127.0.0.1", port, 1, 2, timeout_s=30)
        gone.wait(30)
        try:
            link.receive(u.manifest, np.empty(u.manifest.total, np.uint8))
        except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
            raised.append(exc)

    t = threading.Thread(target=receiver)
    t.start()
    trainer = Link("127.0.0.1", port, 0, 2, timeout_s=30, store=store)  # returns once both have joined
    trainer.close()
    del trainer
    gc.collect()
    gone.set()
    t.join(30)
    assert len(raised) == 1 and isinstance(raised[0], LinkBroken), raised
    assert "rank 1 of 2: receiving bucket 0" in str(raised[0])
