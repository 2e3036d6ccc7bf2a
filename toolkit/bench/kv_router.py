"""The router's own cost of KV events, in one process: the router object with links that hand its
messages back to this process (no sockets), ``bench router``'s instant replicas as sim prefix caches
(their events batch taken in every arm, sent only with events on), and a client keeping ``window``
requests out, hashing its prompts where the router asks it to. Only the router's calls are timed, in
this thread's CPU seconds: the replicas, the client and the sockets are not in it, as for a router on a
core of its own. Method: docs/benchmarks.md#kv.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from toolkit.bench.router import (
    KV_BLOCK,
    _answer,
    bench_config,
    cache_events,
    client_messages,
    instant_cache,
    instant_register,
    session_done_before,
)
from toolkit.core import protocol as P
from toolkit.core.lifecycle import quiet_gc
from toolkit.core.rundir import RunDir
from toolkit.engine.prefix_cache import PrefixCache
from toolkit.router.links import Links
from toolkit.router.server import Router

EVENT_ARMS = {"events": ("kv_aware", KV_BLOCK), "no_events": ("kv_aware", 0), "consistent_hash": ("consistent_hash", 0)}
"""Routers of the events bench: ``kv_aware`` with its replicas' events flowing, without (its index empty,
it routes by consistent hashing), and consistent hashing (the feature off)."""
_T_GEN, _T_RES = P.TYPE_OF[P.Generate], P.TYPE_OF[P.Result]
_T_RESYNC = P.TYPE_OF[P.KvResync]
_enc = msgspec.msgpack.Encoder()
_dec_gen = msgspec.msgpack.Decoder(P.Generate)


class _Inbox(Links):
    """The router's links: what it sends a replica waits here; Results to the client are counted."""

    def __init__(self) -> None:
        self.to_replicas: list[tuple[bytes, tuple[bytes, ...]]] = []
        self.answered = 0

    def to_replica(self, ident: bytes, *frames: bytes) -> None:
        self.to_replicas.append((ident, frames))

    def to_client(self, ident: bytes, *frames: bytes) -> None:
        self.answered += frames[0] == _T_RES


class _Fleet:
    """A router and its replicas in this process; :meth:`call` runs one router call, timed."""

    def __init__(self, policy: str, block: int, replicas: int, window: int, run_dir: RunDir) -> None:
        self.cfg = bench_config(replicas, max(1, 2 * window // replicas), policy, metrics=False)
        self.links = _Inbox()
        self.router = Router(self.cfg, run_dir, links=self.links)
        self.block = block
        self.cpu_ns = 0
        self.caches: dict[bytes, PrefixCache] = {}
        for i in range(replicas):
            rid = f"bench-{i}@in-process"
            self.caches[rid.encode()] = instant_cache(KV_BLOCK)
            self.call(self.router.on_backend, rid.encode(),
                      *P.encode(instant_register(rid, "bench", self.cfg.groups["bench"].max_inflight, block)))
        self.serve()

    def call(self, fn: Any, *args: Any) -> None:
        t0 = time.thread_time_ns()
        fn(*args)
        self.cpu_ns += time.thread_time_ns() - t0

    def serve(self) -> None:
        """The replicas answer what the router sent them (each Result with its cache's events batch, sent
        only with events on), then the router dispatches, until nothing is left to answer."""
        while self.links.to_replicas:
            batch, self.links.to_replicas = self.links.to_replicas, []
            for ident, frames in batch:
                cache = self.caches[ident]
                assert cache.log is not None
                if frames[0] == _T_GEN:
                    kv = cache_events(cache, _dec_gen.decode(frames[1]))
                    res = _answer(frames[1], ident.decode(), "bench")
                    self.call(self.router.on_backend, ident, _T_RES, res, *(kv if self.block else ()))
                elif frames[0] == _T_RESYNC:
                    self.call(self.router.on_backend, ident, *P.encode(cache.log.snapshot(list(cache.blocks))))
            self.call(self.router.dispatch)


class _Drive:
    """``n`` requests of ``prompt_of``'s ``prompts`` through one fleet, a cycle at a time (:meth:`cycle`: fill
    the window, dispatch, answer), so that several fleets take turns on the same core."""

    def __init__(self, policy: str, block: int, n: int, prompts: str, window: int, replicas: int,
                 run_dir: RunDir) -> None:
        self.payloads = [_enc.encode(msg) for msg in client_messages(n, prompts, block, "c")]
        self.fleet = _Fleet(policy, block, replicas, window, run_dir)
        self.fleet.cpu_ns = 0
        self.n, self.prompts, self.window = n, prompts, window
        self.sent = 0

    @property
    def done(self) -> bool:
        return self.fleet.links.answered >= self.n

    def cycle(self) -> None:
        fleet, router = self.fleet, self.fleet.router
        while self.sent < self.n and self.sent - fleet.links.answered < self.window:
            k = self.sent
            done_msg = session_done_before(k, self.prompts)
            if done_msg is not None:
                fleet.call(router.on_frontend, b"client", *P.encode(done_msg))
            fleet.call(router.on_frontend, b"client", _T_GEN, self.payloads[k])
            self.sent += 1
        fleet.call(router.dispatch)
        fleet.serve()


def cpu_us(n: int, prompts: str, window: int = 1024, replicas: int = 4) -> dict[str, float]:
    """Each arm of :data:`EVENT_ARMS`'s router CPU microseconds per request for ``n`` requests, the arms' fleets
    taking turns a cycle each (a slower spell of the machine falls on all of them alike)."""
    with tempfile.TemporaryDirectory(prefix="bench-kv-router-") as tmp:
        drives = {}
        for name, (policy, block) in EVENT_ARMS.items():
            rd = RunDir(Path(tmp) / name)
            rd.make()
            drives[name] = _Drive(policy, block, n, prompts, window, replicas, rd)
        try:
            quiet_gc()  # as the router process does once it is up
            while not all(d.done for d in drives.values()):
                for d in drives.values():
                    if not d.done:
                        d.cycle()
            return {name: d.fleet.cpu_ns / n / 1000 for name, d in drives.items()}
        finally:
            for d in drives.values():
                d.fleet.router.close()


def cpu_ratio(n: int, rounds: int, prompts: str) -> dict[str, Any]:
    """:func:`cpu_us` ``rounds`` times: per arm the median, and the median and range of the rounds' ratios
    ``no_events`` / ``events`` (events on vs off)."""
    runs = [cpu_us(n, prompts) for _ in range(rounds)]
    ratios = sorted(r["no_events"] / r["events"] for r in runs)
    return {"router_cpu_us_per_request": {a: round(statistics.median(r[a] for r in runs), 2) for a in EVENT_ARMS},
            "cpu_ratio_events_on": round(ratios[len(ratios) // 2], 4),
            "cpu_ratio_events_on_range": [round(ratios[0], 4), round(ratios[-1], 4)],
            "rounds": rounds, "requests": n, "prompts": prompts}
