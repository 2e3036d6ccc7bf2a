"""A worker of a two-worker replica on a streamed update's chain, in its own process (``python -m``): a
``Receiver`` holding ``--held`` (an npz of the base's tensors) and the regions the test gives it, staging
each manifest the test names at its place (first worker or the other), and printing one JSON line per
update: the checksum of what it kept of each tensor (a dense tensor's region, a delta whole), or the error."""

from __future__ import annotations

import argparse
import json
import time
import zlib

import msgspec
import numpy as np

from toolkit.engine.vllm_receiver import Place, Receiver
from toolkit.weights.shards import Region, Slot
from toolkit.weights.wire import Manifest


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ports", type=int, nargs="+", required=True, help="each update's rendezvous, in order")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--regions", required=True, help="JSON: name -> [offset, rows, cols, stride]")
    p.add_argument("--held", required=True, help="npz of the base version's tensors (bits), version 1")
    p.add_argument("--manifests", nargs="+", required=True)
    a = p.parse_args()
    r = Receiver()
    r.regions = {n: Region(*v) for n, v in json.loads(a.regions).items()}
    base = np.load(a.held)
    for name in base.files:
        b = base[name]
        slot = r.held[name] = Slot(r.regions.get(name) or Region.whole(b.size), b.shape, "bfloat16")
        slot.region.gather(b.reshape(-1), slot.bits)
    r.version = 1
    for path, port in zip(a.manifests, a.ports, strict=True):
        with open(path, "rb") as f:
            m = msgspec.msgpack.decode(f.read(), type=Manifest)
        r.stage(m, "127.0.0.1", port, Place(first=1, index=a.index, workers=2, prev=0, world=3), "127.0.0.1", 30)
        while r.status["state"] == "staging":
            time.sleep(0.01)
        if r.status["state"] != "staged":
            print(json.dumps({"error": r.status.get("error")}), flush=True)
            return
        assert r._staged is not None
        parts = r._staged[1]
        crc = {n: zlib.crc32(b.tobytes()) for n, b in parts.dense.items()}
        crc.update({n: zlib.crc32(i.tobytes() + v.tobytes()) for n, (i, v) in parts.deltas.items()})
        print(json.dumps({"version": m.version, "kept": r.status["kept"], "crc": crc}), flush=True)
        r.discard()
        r.version = m.version


if __name__ == "__main__":
    main()
