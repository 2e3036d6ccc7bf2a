"""Receiver ranks of a streamed update's chain, each in its own process (``python -m``): join the group
the test's trainer hosts, receive the manifests it names, decode them against what they hold, and
print one JSON line per update (the checksum of every tensor, or the error)."""

from __future__ import annotations

import argparse
import json
import os
import zlib

import msgspec
import numpy as np

from toolkit.weights.transport import Link
from toolkit.weights.wire import Manifest, decode


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--manifests", nargs="+", required=True, help="files, one update each, in order")
    p.add_argument("--die-after", type=int, default=-1, help="exit (as a crash) once this many bytes of the last update are in")
    a = p.parse_args()
    link = Link("127.0.0.1", a.port, a.rank, a.world, timeout_s=30)
    held, state = 0, {}
    for i, path in enumerate(a.manifests):
        with open(path, "rb") as f:
            m = msgspec.msgpack.decode(f.read(), type=Manifest)
        staging = np.empty(m.total, np.uint8)

        def progress(done: int, last: bool = i == len(a.manifests) - 1) -> None:
            if last and a.die_after >= 0 and done >= a.die_after:
                os._exit(17)

        try:
            link.receive(m, staging, progress)
            state = decode(m, staging, held, state)
            held = m.version
            print(json.dumps({"version": held, "crc": {k: zlib.crc32(v.tobytes()) for k, v in state.items()}}),
                  flush=True)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
            return


if __name__ == "__main__":
    main()
