"""How a streamed update moves: a chain over torch.distributed's gloo, trainer -> replica 1 -> ... -> n.

Rank 0 (the trainer) hosts the rendezvous (a ``TCPStore``) and sends the payload in buckets to rank
1; each receiver writes a bucket straight into its staging buffer and forwards it to the next rank
while the following bucket arrives. So the trainer's uplink carries one copy whatever the number of
replicas, and an update of ``B`` bytes over ``n`` receivers takes about ``B / link + (n - 1) *
bucket / link``: the chain's fill time is one bucket per hop. Two buckets are in flight per link
(double buffering), so packing the next one overlaps sending this one. A replica of several workers is
one hop: its first worker passes each other worker only its share of each bucket
(``toolkit/weights/shards.py``).

torch is imported inside functions here: it is the ``vllm`` extra's (or the trainer's own), and the
checkpoint path never needs it.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toolkit.core.errors import ToolkitError
from toolkit.weights.shards import Keep, Share
from toolkit.weights.wire import Manifest, bucket_ranges

WINDOW = 2
"""Buckets in flight per link."""
TAG = 1 << 24
"""Tags of messages other than buckets (a bucket's tag is its number)."""


def _ring(torch: Any, n: int, nbytes: int) -> list[Any]:
    return [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n)]


@dataclass
class _Sibling:
    """Another worker of this replica, sent its share of each bucket: from a ring of buffers, a send each."""

    rank: int
    share: Share
    buffers: list[Any]
    works: list[Any] = field(default_factory=list)
    """Its sends in flight, oldest first."""
    sent: int = 0


class LinkBroken(ToolkitError):
    """A peer of the chain died, or the link stalled past its timeout, mid-update."""


def require_torch() -> Any:
    """torch (the trainer's, or the vllm extra's): its ``distributed`` carries every streamed update, so a
    process without it cannot stream. ToolkitError saying so."""
    try:
        import torch  # heavy and optional: imported where an update is streamed, not with the toolkit
    except ImportError as exc:
        raise ToolkitError(f"streamed weights need torch (torch.distributed carries the update): {exc}; install "
                           "torch in the trainer's environment, or publish checkpoints (toolkit.weights.publish) "
                           "with rollout.weights_transport=checkpoint") from None
    return torch


class Link:
    """One rank's place in an update's chain (``rank`` 0: the trainer, which hosts the rendezvous)."""

    def __init__(self, master: str, port: int, rank: int, world: int, timeout_s: float, host: str = "",
                 store: Any = None) -> None:
        torch = require_torch()
        dist = torch.distributed
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world = rank, world
        self.store = store if store is not None else dist.TCPStore(master, port, world, is_master=False,
                                                                   timeout=timeout)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host or master)]
        try:
            self.pg = dist.ProcessGroupGloo(self.store, rank, world, opts)
        except RuntimeError as exc:
            raise LinkBroken(f"rank {rank} of {world} could not join the update's group at {master}:{port}: {exc}") \
                from exc

    @staticmethod
    def rendezvous(host: str, world: int | None, timeout_s: float) -> tuple[Any, int]:
        """The trainer's store on a free port of ``host``: (store, port) to hand to the receivers."""
        dist = require_torch().distributed
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        return store, store.port

    def _wait(self, work: Any, what: str) -> None:
        with self._broken(what):
            work.wait()

    @contextlib.contextmanager
    def _broken(self, what: str) -> Iterator[None]:
        """gloo's errors as ``LinkBroken``: a peer's death shows in ``wait`` or already when the next
        send or receive is posted (gloo: "Connection closed by peer")."""
        try:
            yield
        except RuntimeError as exc:
            raise LinkBroken(f"rank {self.rank} of {self.world}: {what}: {exc}") from exc

    # ---- rank 0 -------------------------------------------------------------------------------
    def send(self, manifest: Manifest, pieces: list[np.ndarray]) -> None:
        """Send the payload (``pieces``, uint8, in manifest order) to rank 1, bucket by bucket. A
        bucket inside one piece goes as a view of it; one across pieces is packed into a buffer."""
        torch = require_torch()
        buffers = [np.empty(manifest.bucket_bytes, np.uint8) for _ in range(WINDOW)]
        starts = np.cumsum([0] + [p.size for p in pieces])
        works: list[Any] = []
        for k, (s, e) in enumerate(manifest.buckets()):
            if len(works) == WINDOW:
                self._wait(works.pop(0), f"sending bucket {k - WINDOW}")
            i = int(np.searchsorted(starts, s, side="right")) - 1
            if e <= starts[i + 1]:
                chunk = pieces[i][s - starts[i]:e - starts[i]]
            else:
                chunk = buffers[k % WINDOW][:e - s]
                at, j = 0, i
                while at < e - s:
                    take = pieces[j][max(s, starts[j]) - starts[j]:min(e, starts[j + 1]) - starts[j]]
                    chunk[at:at + take.size] = take
                    at += take.size
                    j += 1
            with self._broken(f"sending bucket {k}"):
                works.append(self.pg.send([torch.from_numpy(chunk)], 1, k))
        for w in works:
            self._wait(w, "sending the last buckets")

    # ---- ranks 1..n ---------------------------------------------------------------------------
    def receive(self, manifest: Manifest, staging: np.ndarray | None, progress: Callable[[int], None] | None = None,
                keep: Callable[[np.ndarray, int], None] | None = None, prev: int | None = None,
                next: int | None = -1, siblings: Sequence[tuple[int, Share]] = ()) -> None:
        """Receive the payload from rank ``prev`` (the rank before, by default) into ``staging`` (uint8,
        ``manifest.total`` bytes), forwarding each bucket to rank ``next`` (the rank after unless this is
        the last, by default; None: none) as soon as it is in. With ``keep`` (a worker that keeps only
        its share) buckets land in a ring of a few instead, each handed to ``keep(bucket, start)`` once
        it is in. ``siblings``: the other workers of this replica, each sent its share of every bucket
        (:meth:`receive_share`)."""
        torch = require_torch()
        prev = self.rank - 1 if prev is None else prev
        if next == -1:
            next = self.rank + 1 if self.rank < self.world - 1 else None
        ranges = bucket_ranges(manifest.total, manifest.bucket_bytes)
        if keep is None:
            assert staging is not None
            view = torch.from_numpy(staging)

            def place(k: int) -> Any:
                return view[ranges[k][0]:ranges[k][1]]
        else:
            # a bucket's slot is posted WINDOW buckets ahead and read until its forward (WINDOW more) is done
            ring = _ring(torch, min(len(ranges), 2 * WINDOW + 1), min(manifest.bucket_bytes, manifest.total))

            def place(k: int) -> Any:
                return ring[k % len(ring)][:ranges[k][1] - ranges[k][0]]
        out = [_Sibling(rank, share, _ring(torch, min(len(ranges), WINDOW + 1), min(manifest.bucket_bytes, manifest.total)))
               for rank, share in siblings]
        recvs: list[Any] = []
        sends: list[Any] = []
        posted = 0
        for k, (s, e) in enumerate(ranges):
            while posted < len(ranges) and posted < k + WINDOW:
                with self._broken(f"receiving bucket {posted} from rank {prev}"):
                    recvs.append(self.pg.recv([place(posted)], prev, posted))
                posted += 1
            self._wait(recvs[k], f"receiving bucket {k} from rank {prev}")
            bucket = place(k)
            if next is not None:
                if len(sends) == WINDOW:  # a gloo Work is waited once: a second wait waits for another
                    self._wait(sends.pop(0), f"forwarding bucket {k - WINDOW} to rank {next}")
                with self._broken(f"forwarding bucket {k} to rank {next}"):
                    sends.append(self.pg.send([bucket], next, k))
            for o in out:
                if len(o.works) == WINDOW:  # then the buffer of the send before those in flight is free
                    self._wait(o.works.pop(0), f"sending rank {o.rank} its share of a bucket before {k}")
                part = o.buffers[o.sent % len(o.buffers)]  # by sends, not buckets: a bucket may hold none of its share
                n = o.share.extract(bucket.numpy(), s, part.numpy())
                if n:
                    with self._broken(f"sending rank {o.rank} its share of bucket {k}"):
                        o.works.append(self.pg.send([part[:n]], o.rank, k))
                    o.sent += 1
            if keep is not None:
                keep(bucket.numpy(), s)
            if progress is not None:
                progress(e)
        for w in sends:
            self._wait(w, f"forwarding the last buckets to rank {next}")
        for o in out:
            for w in o.works:
                self._wait(w, f"sending rank {o.rank} its share of the last buckets")

    def receive_share(self, manifest: Manifest, head: int, keep: Keep,
                      progress: Callable[[int], None] | None = None) -> None:
        """Receive this worker's share of every bucket from rank ``head`` (the first worker of its replica,
        which receives the whole of it) into ``keep``."""
        torch = require_torch()
        ranges = bucket_ranges(manifest.total, manifest.bucket_bytes)
        sizes = [keep.share.size(s, e) for s, e in ranges]
        wanted = [k for k, n in enumerate(sizes) if n]
        ring = _ring(torch, min(len(wanted), WINDOW + 1), max(sizes, default=0))
        recvs: list[Any] = []
        for j, k in enumerate(wanted):
            while len(recvs) < len(wanted) and len(recvs) < j + WINDOW:
                q = wanted[len(recvs)]
                with self._broken(f"receiving its share of bucket {q} from rank {head}"):
                    recvs.append(self.pg.recv([ring[len(recvs) % len(ring)][:sizes[q]]], head, q))
            self._wait(recvs[j], f"receiving its share of bucket {k} from rank {head}")
            keep.place(ring[j % len(ring)][:sizes[k]].numpy(), *ranges[k])
            if progress is not None:
                progress(ranges[k][1])
        if progress is not None:
            progress(manifest.total)

    def send_bytes(self, dst: int, data: bytes) -> None:
        """A small message to rank ``dst`` (its length, then it), outside the buckets' tags."""
        torch = require_torch()
        parts = [(torch.tensor([len(data)], dtype=torch.int64), TAG)]
        if data:
            parts.append((torch.frombuffer(bytearray(data), dtype=torch.uint8), TAG + 1))
        for t, tag in parts:
            with self._broken(f"sending rank {dst} a message"):
                work = self.pg.send([t], dst, tag)
            self._wait(work, f"sending rank {dst} a message")

    def recv_bytes(self, src: int) -> bytes:
        torch = require_torch()
        n = torch.zeros(1, dtype=torch.int64)
        with self._broken(f"receiving a message from rank {src}"):
            work = self.pg.recv([n], src, TAG)
        self._wait(work, f"receiving a message from rank {src}")
        data = torch.empty(int(n.item()), dtype=torch.uint8)
        if data.numel():
            with self._broken(f"receiving a message from rank {src}"):
                work = self.pg.recv([data], src, TAG + 1)
            self._wait(work, f"receiving a message from rank {src}")
        return data.numpy().tobytes()

    # ---- every rank: the link's own bound ------------------------------------------------------
    def broadcast_raw(self, buf: Any) -> float:
        """A plain gloo broadcast of the uint8 tensor ``buf`` from rank 0 to every rank: seconds it took
        here (the link bound a benchmark compares the chain with). The caller keeps ``buf`` from round to
        round, as the chain keeps its staging buffers: a fresh tensor would add its page faults to the bound."""
        torch = require_torch()
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        t0 = time.perf_counter()
        with self._broken("a raw broadcast"):
            work = self.pg.broadcast([buf], opts)
        self._wait(work, "a raw broadcast")
        return time.perf_counter() - t0

    def barrier(self) -> None:
        with self._broken("a barrier"):
            work = self.pg.barrier()
        self._wait(work, "a barrier")

    def close(self) -> None:
        self.pg = None
        self.store = None
