"""A trainer in its own process (``python -m``): stream the tensors of a checkpoint directory, with every
element of a share of them nudged by one bit, into a run's replicas as one version, and print what
the ``Streamer`` reports. ``--die-after-buckets K``: the process dies (``os._exit``) once K buckets of
the payload are sent, mid-update."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run")
    p.add_argument("ckpt")
    p.add_argument("version", type=int)
    p.add_argument("--nudge", type=float, default=0.0, help="share of each tensor's elements changed")
    p.add_argument("--bucket-mb", type=float, default=0.0625)
    p.add_argument("--die-after-buckets", type=int, default=-1)
    a = p.parse_args()

    from toolkit.engine.vllm_receiver import read_checkpoint, to_torch
    from toolkit.weights import Streamer, transport

    if a.die_after_buckets >= 0:
        sent = 0
        send = transport.Link.send

        def dying(self, manifest, pieces):  # type: ignore[no-untyped-def]
            def count(*args):  # type: ignore[no-untyped-def]
                nonlocal sent
                sent += 1
                if sent > a.die_after_buckets:
                    os._exit(17)
                return real(*args)

            real = self.pg.send
            self.pg = type("PG", (), {"send": staticmethod(count), "recv": self.pg.recv})()
            return send(self, manifest, pieces)

        transport.Link.send = dying  # type: ignore[method-assign]

    rng = np.random.default_rng(a.version)
    tensors = []
    for name, (b, dtype) in read_checkpoint(a.ckpt).items():
        b = b.copy()
        flat = b.reshape(-1)
        if a.nudge:
            flat[rng.choice(flat.size, max(1, int(flat.size * a.nudge)), replace=False)] ^= 1
        tensors.append((name, to_torch(b, dtype)))
    with Streamer(a.run, bucket_mb=a.bucket_mb, delta=False, timeout_s=30) as s:
        s.send(a.version, tensors)
        print(json.dumps(s.last), flush=True)


if __name__ == "__main__":
    main()
