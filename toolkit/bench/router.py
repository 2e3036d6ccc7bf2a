"""``python -m toolkit.bench router``: the router's cost against a minimal pyzmq broker.

Three measures: throughput against a broker with the same sockets and payloads and no policy; the
throughput cost of serving Prometheus metrics; and the cost of one dispatch decision with 512 and
with 4,096 replicas, 50,000 requests queued. Method: docs/benchmarks.md#router.
"""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import random
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from toolkit.client import CHAINS_KEPT, hash_prompt
from toolkit.config import Config, GroupConfig, ReportConfig, RouterConfig, SimEngineConfig
from toolkit.core import protocol as P
from toolkit.core.blocks import Chains
from toolkit.core.rundir import RunDir
from toolkit.core.sockets import make_socket
from toolkit.engine.kv_events import KvEventLog
from toolkit.engine.prefix_cache import PrefixCache
from toolkit.launch.stack import LocalStack
from toolkit.router.server import Router

PROMPT_LEN = 128
OUTPUT_LEN = 16
SESSIONS = 5000
"""Sessions the decision bench's requests belong to."""
KV_BLOCK = 16
KV_CAPACITY = 200_000
"""Tokens of each instant replica's prefix cache (``kv_aware``'s events)."""

_enc = msgspec.msgpack.Encoder()
_dec_gen = msgspec.msgpack.Decoder(P.Generate)


def _answer(payload: bytes, replica_id: str, group: str) -> bytes:
    req = _dec_gen.decode(payload)
    res = P.Result(req.request_id, "ok", list(range(1, OUTPUT_LEN + 1)), [-0.5] * OUTPUT_LEN, "stop",
                   replica_id, group)
    return _enc.encode(res)


def instant_register(rid: str, group: str, max_inflight: int, kv_block_size: int) -> P.Register:
    """An instant replica's Register (``kv_block_size``: it reports KV events at that block size; 0: none)."""
    return P.Register(rid, group, {"group": group}, "instant", max_inflight, 100000, 1 << 20,
                      kv_block_size=kv_block_size, kv_capacity_tokens=KV_CAPACITY)


def instant_cache(block: int) -> PrefixCache:
    """An instant replica's prefix cache, logging its KV events."""
    cache = PrefixCache(block, KV_CAPACITY)
    cache.log = KvEventLog()
    return cache


def cache_events(cache: PrefixCache, req: P.Generate) -> list[bytes]:
    """An instant replica serves ``req``: its prefix cache (with an event log) stores the prompt and the
    answer's tokens; the events batch since the last, as the frame a Result carries (none if no change)."""
    cache.insert(req.prompt_token_ids + list(range(1, OUTPUT_LEN + 1)))
    assert cache.log is not None
    return cache.log.frames()


def client_messages(n: int, prompts: str, block_size: int = 0, prefix: str = "") -> list[P.Generate]:
    """The client's ``n`` requests of ``prompt_of``'s ``prompts`` (ids ``prefix-i``); with ``block_size``,
    each carries its prompt's block hashes, as a ``RouterClient`` told the block size by its Routes sends them."""
    chains = Chains(CHAINS_KEPT)
    msgs = [P.Generate(f"{prefix}-{i}", "bench", f"s{i % 997}-{i // (997 * 8)}" if prompts == "turns" else f"s{i % 997}",
                       0, prompt_of(i, prompts), P.Sampling(OUTPUT_LEN)) for i in range(n)]
    if block_size:
        for msg in msgs:
            hash_prompt(chains, msg, block_size)
    return msgs


def session_done_before(k: int, prompts: str) -> P.SessionDone | None:
    """What the client says before request ``k``: with ``turns``, a session's first turn follows one that is
    done (997 * 8 requests back), as a rank says it."""
    if prompts == "turns" and k >= 997 * 8 and k % (997 * 8) < 997:
        prev = k - 997 * 8
        return P.SessionDone("bench", 0, f"s{prev % 997}-{prev // (997 * 8)}")
    return None


def instant_replicas(backend: str, n: int, group: str, max_inflight: int, heartbeat_s: float,
                     kv_block_size: int = 0, cache_block: int = 0) -> None:
    """``n`` replicas in one process that answer every Generate at once (a process target). With
    ``cache_block``, each keeps a sim prefix cache of what it served and takes its KV events batch after
    each request, as an engine does whether it reports them or not; with ``kv_block_size`` (its block
    size), each also sends that batch with each Result, as a replica process does. Taking the batch either
    way keeps the replicas' own work the same with events on and off: on one machine their processes
    share its cores with the router, and a difference there would be counted against the router."""
    ctx = zmq.Context()
    caches: dict[str, PrefixCache] = {}
    socks = []
    poller = zmq.Poller()
    for i in range(n):
        rid = f"{group}-{i}@instant:{os.getpid()}"
        s = make_socket(ctx, zmq.DEALER, rid)
        s.connect(backend)
        socks.append((s, rid))
        poller.register(s, zmq.POLLIN)

    block = kv_block_size or cache_block

    def register(s: zmq.Socket, rid: str) -> None:
        s.send_multipart(P.encode(instant_register(rid, group, max_inflight, kv_block_size)))
        if block:
            caches[rid] = instant_cache(block)

    def events(rid: str, payload: bytes) -> list[bytes]:
        """The KV events frame a Result carries (empty when nothing changed or the replica does not report
        them), as a replica sends it; the batch is taken (encoded) either way."""
        frames = cache_events(caches[rid], _dec_gen.decode(payload))
        return frames if kv_block_size else []

    for s, rid in socks:
        register(s, rid)
    by_sock = dict(socks)
    next_beat = time.monotonic()
    t_gen = P.TYPE_OF[P.Generate]
    t_res = P.TYPE_OF[P.Result]
    while True:
        for s, _ in poller.poll(50):
            rid = by_sock[s]
            for _ in range(256):
                try:
                    mtype, payload = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if mtype == t_gen:
                    kv = events(rid, payload) if block else []
                    s.send_multipart([t_res, _answer(payload, rid, group), *kv])
                elif mtype == P.TYPE_OF[P.Reregister]:
                    register(s, rid)
                elif mtype == P.TYPE_OF[P.KvResync] and rid in caches:
                    log = caches[rid].log
                    assert log is not None
                    s.send_multipart(P.encode(log.snapshot(list(caches[rid].blocks))))
        if time.monotonic() >= next_beat:
            for s, rid in socks:
                s.send_multipart(P.encode(P.Heartbeat(rid, P.ReplicaStats(generated_tokens=int(time.monotonic() * 1000)))))
            next_beat = time.monotonic() + heartbeat_s


def raw_broker(addr_q: Any) -> None:
    """The baseline: ROUTER front, ROUTER back, decode the Generate, hash to a worker, forward."""
    ctx = zmq.Context()
    front, back = make_socket(ctx, zmq.ROUTER), make_socket(ctx, zmq.ROUTER)
    for s in (front, back):
        s.bind("tcp://127.0.0.1:*")
    addr_q.put((front.getsockopt_string(zmq.LAST_ENDPOINT), back.getsockopt_string(zmq.LAST_ENDPOINT)))
    workers: list[bytes] = []
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    while True:
        events = dict(poller.poll(100))
        if back in events:
            for _ in range(4096):
                try:
                    frames = back.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) == 2:  # [worker, b"READY"]
                    workers.append(frames[0])
                else:
                    front.send_multipart(frames[1:])
        if front in events and workers:
            for _ in range(4096):
                try:
                    client, mtype, payload = front.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = _dec_gen.decode(payload)
                w = workers[hash(msg.session_id) % len(workers)]
                back.send_multipart([w, client, mtype, payload])


def raw_workers(backend: str, n: int) -> None:
    ctx = zmq.Context()
    poller = zmq.Poller()
    socks = []
    for _ in range(n):
        s = make_socket(ctx, zmq.DEALER)
        s.connect(backend)
        s.send(b"READY")
        poller.register(s, zmq.POLLIN)
        socks.append(s)
    t_res = P.TYPE_OF[P.Result]
    while True:
        for s, _ in poller.poll(100):
            for _ in range(256):
                try:
                    client, _mtype, payload = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                s.send_multipart([client, t_res, _answer(payload, "raw", "raw")])


def prompt_of(i: int, prompts: str) -> list[int]:
    """Request ``i``'s prompt: ``same``: one prompt for all (``bench router``'s); ``distinct``: a prompt of
    its own each (all new blocks for a prefix cache); ``turns``: 997 sessions of 8 turns, each turn's
    prompt its session's last one, that turn's output (the instant replicas say ``1..OUTPUT_LEN``) and 8
    observation tokens."""
    if prompts == "distinct":
        return [(i * 131 + k) % 30011 + 1 for k in range(PROMPT_LEN)]
    if prompts == "turns":
        s, turn = i % 997, (i // 997) % 8
        ctx = [(s * 131 + k) % 30011 + 1 for k in range(PROMPT_LEN)]
        for t in range(turn):
            ctx += list(range(1, OUTPUT_LEN + 1)) + [(s * 7 + t * 13 + k) % 30011 + 1 for k in range(8)]
        return ctx
    return list(range(1, PROMPT_LEN + 1))


def client(frontend: str, n: int, window: int, out_q: Any, prompts: str = "same", block_size: int = 0) -> None:
    """Keep ``window`` requests outstanding; report requests/s from first send to last result. With
    ``block_size``, each prompt carries its block hashes, as a ``RouterClient`` told it by a ``kv_aware``
    router sends them (computed before the clock starts, as the requests are)."""
    payloads = [_enc.encode(msg) for msg in client_messages(n, prompts, block_size, str(os.getpid()))]
    ctx = zmq.Context()
    s = make_socket(ctx, zmq.DEALER)
    s.connect(frontend)
    t_gen = P.TYPE_OF[P.Generate]
    sent = done = 0
    t0 = time.perf_counter()
    while done < n:
        while sent < n and sent - done < window:
            done_msg = session_done_before(sent, prompts)
            if done_msg is not None:
                s.send_multipart(P.encode(done_msg))
            s.send_multipart([t_gen, payloads[sent]])
            sent += 1
        s.recv_multipart()
        done += 1
        while True:
            try:
                s.recv_multipart(zmq.NOBLOCK)
                done += 1
            except zmq.Again:
                break
    out_q.put(n / (time.perf_counter() - t0))
    s.close()
    ctx.term()


def _run_client(frontend: str, n: int, window: int, prompts: str = "same", block_size: int = 0) -> float:
    mpc = mp.get_context("spawn")
    q = mpc.Queue()
    p = mpc.Process(target=client, args=(frontend, n, window, q, prompts, block_size), daemon=True)
    p.start()
    try:
        return float(q.get(timeout=300))
    finally:
        p.join(10)


def bench_config(replicas: int, max_inflight: int, policy: str = "consistent_hash", metrics: bool = True) -> Config:
    return Config(engine=SimEngineConfig(), groups={"bench": GroupConfig(replicas=replicas, max_inflight=max_inflight)},
                  router=RouterConfig(policy=policy), report=ReportConfig(metrics=metrics))


def _scraper(run_dir: Path, stop: threading.Event) -> None:
    """Prometheus' part: GET the router's /metrics once a second until ``stop``."""
    target = json.loads((run_dir / "metrics" / "router.json").read_text())["target"]
    while not stop.wait(1.0):
        urllib.request.urlopen(f"http://{target}/metrics", timeout=5).read()


def metrics_ratio(n: int, window: int, replicas: int, rounds: int, on_first: bool = True) -> tuple[float, float, float]:
    """Best requests/s of a router serving metrics (scraped every second) and of one without, and the
    median over rounds of the paired ratio (each round runs both, in alternating order, so a drift of
    the machine's speed cancels)."""
    mpc = mp.get_context("spawn")
    rates: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        stacks, procs = {}, []
        stop = threading.Event()
        try:
            for on in (on_first, not on_first):
                cfg = bench_config(replicas, max_inflight=max(1, 2 * window // replicas), metrics=on)
                stack = stacks[on] = LocalStack(cfg, Path(tmp) / f"run-{on}")  # stopped below whatever fails next
                stack.start_router()
                backend = stack.run_dir.wait_router_address(10)["backend"]
                procs.append(mpc.Process(target=instant_replicas, args=(backend, replicas, "bench",
                                                                         cfg.groups["bench"].max_inflight, 0.5),
                                         daemon=True))
                procs[-1].start()
                stack.wait_ready(30)
            scraper = threading.Thread(target=_scraper, args=(stacks[True].run_dir.root, stop), daemon=True)
            scraper.start()
            for on in (True, False):
                _run_client(stacks[on].frontend, min(n, 2000), window)  # warm both
            for k in range(rounds):
                for on in ((True, False) if k % 2 == 0 else (False, True)):
                    rates[on].append(_run_client(stacks[on].frontend, n, window))
        finally:
            stop.set()
            for p in procs:
                p.terminate()
                p.join(5)
            for stack in stacks.values():
                stack.stop()
    paired = sorted(a / b for a, b in zip(rates[True], rates[False], strict=True))
    return max(rates[True]), max(rates[False]), paired[len(paired) // 2]


def throughput(n: int, window: int, replicas: int, rounds: int) -> tuple[float, float]:
    mpc = mp.get_context("spawn")
    cfg = bench_config(replicas, max_inflight=max(1, 2 * window // replicas))
    router_rps, raw_rps = [], []
    with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
        stack = LocalStack(cfg, Path(tmp) / "run")
        procs = []
        try:
            stack.start_router()
            backend = stack.run_dir.wait_router_address(10)["backend"]
            procs.append(mpc.Process(target=instant_replicas, args=(backend, replicas, "bench",
                                                                     cfg.groups["bench"].max_inflight, 0.5),
                                     daemon=True))
            aq = mpc.Queue()
            procs.append(mpc.Process(target=raw_broker, args=(aq,), daemon=True))
            for p in procs:
                p.start()
            raw_front, raw_back = aq.get(timeout=30)
            procs.append(mpc.Process(target=raw_workers, args=(raw_back, replicas), daemon=True))
            procs[-1].start()
            stack.wait_ready(30)
            time.sleep(0.5)  # raw workers' READY reached the broker
            _run_client(stack.frontend, min(n, 2000), window)  # warm both paths
            _run_client(raw_front, min(n, 2000), window)
            for _ in range(rounds):
                raw_rps.append(_run_client(raw_front, n, window))
                router_rps.append(_run_client(stack.frontend, n, window))
        finally:
            for p in procs:
                p.terminate()
                p.join(5)
            stack.stop()
    return max(router_rps), max(raw_rps)


@contextmanager
def fleet_router(replicas: int, max_inflight: int, policy: str) -> Iterator[tuple[Router, float]]:
    """A router in this process with ``replicas`` registered and ready one by one (no replica processes),
    and the seconds their registrations and readiness took it."""
    cfg = bench_config(replicas, max_inflight, policy)
    kv = policy == "kv_aware"
    with tempfile.TemporaryDirectory(prefix="bench-decide-") as tmp:
        rd = RunDir(Path(tmp))
        rd.make()
        ctx = zmq.Context()
        router = Router(cfg, rd, ctx)
        try:
            router.bind("127.0.0.1")
            gc.collect()  # what the benches before left is not this router's to collect (0.4 s once, here)
            t0 = time.perf_counter()
            for i in range(replicas):
                ident = f"r{i}".encode()
                router.membership.register(ident, P.Register(f"r{i}", "bench", {}, "m", max_inflight, 100000, 1 << 20,
                                                             kv_block_size=KV_BLOCK if kv else 0))
                replica = router.pool.known(ident)
                assert replica is not None
                router.pool.set_ready(replica)
            yield router, time.perf_counter() - t0
        finally:
            router.close()
            ctx.term()


def registration_s(replicas: int = 4096, policy: str = "consistent_hash") -> float:
    """Seconds of the router's loop for ``replicas`` that register and pass their probe one by one (a
    fleet's start)."""
    with fleet_router(replicas, 4, policy) as (_, seconds):
        return seconds


def decision_cost(replicas: int = 512, queued: int = 50000, samples: int = 20000, jobs: int = 8,
                  policy: str = "consistent_hash",
                  setup: Callable[[Router, random.Random], dict[int, list[int]]] | None = None) -> tuple[float, float]:
    """p50 and p99 of one dispatch decision, in microseconds. ``setup``: fills the router's state once its
    replicas are ready, and gives sessions' prompts (``bench kv``: its index)."""
    max_inflight = 4
    rng = random.Random(0)
    with fleet_router(replicas, max_inflight, policy) as (router, _):
        prompts = setup(router, rng) if setup is not None else {}
        prompt = list(range(1, PROMPT_LEN + 1))
        total = queued + replicas * max_inflight
        for k in range(total + samples):
            sid = rng.randrange(SESSIONS)
            msg = P.Generate(f"q{k}", f"job{k % jobs}", f"s{sid}", 0, prompts.get(sid, prompt),
                             P.Sampling(OUTPUT_LEN))
            router.submit(b"client", msg, _enc.encode(msg))
        router.dispatch()  # fills every slot; the rest stays queued
        assert router.queue.size >= queued, router.queue.size
        reps = list(router.pool.all())
        times = []
        while len(times) < samples:
            r = reps[rng.randrange(len(reps))]
            if not r.inflight:
                continue
            rid = next(iter(r.inflight))  # its oldest request finishes
            res = P.Result(rid, "ok", [1], [-0.1], "stop", r.replica_id, "bench")
            router.on_backend(r.identity, *P.encode(res))
            t0 = time.perf_counter_ns()
            router.dispatch()
            times.append(time.perf_counter_ns() - t0)
        a = np.asarray(times, dtype=np.float64) / 1000.0
        return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def run(quick: bool = False) -> dict[str, Any]:
    n = 5000 if quick else 30000
    router_rps, raw_rps = throughput(n=n, window=1024, replicas=4, rounds=1 if quick else 3)
    p50, p99 = decision_cost(samples=2000 if quick else 20000, queued=5000 if quick else 50000)
    p50_4096, p99_4096 = decision_cost(replicas=4096, samples=2000 if quick else 20000,
                                       queued=5000 if quick else 50000)
    register = {p: registration_s(4096, p) for p in ("consistent_hash", "kv_aware")}
    # Started first, a router runs a few percent slower here whatever its config (an A/A run with
    # metrics off in both measured 0.963): each order once, and the geometric mean of the two.
    runs = [metrics_ratio(n=n, window=1024, replicas=4, rounds=1 if quick else 13, on_first=first)
            for first in ((True,) if quick else (True, False))]
    on, off = max(r[0] for r in runs), max(r[1] for r in runs)
    paired = float(np.prod([r[2] for r in runs]) ** (1 / len(runs)))
    return {
        "router_rps_metrics_on": round(on, 1),
        "router_rps_metrics_off": round(off, 1),
        "ratio_metrics_on": round(paired, 3),
        "ratio_metrics_on_by_start_order": [round(r[2], 3) for r in runs],
        "router_rps": round(router_rps, 1),
        "raw_broker_rps": round(raw_rps, 1),
        "ratio": round(router_rps / raw_rps, 3),
        "decision_us_p50": round(p50, 2),
        "decision_us_p99": round(p99, 2),
        "replicas": 512,
        "decision_us_p50_4096": round(p50_4096, 2),
        "decision_us_p99_4096": round(p99_4096, 2),
        "register_s_4096": {p: round(v, 3) for p, v in register.items()},
        "queued": 5000 if quick else 50000,
        "window": 1024,
        "prompt_tokens": PROMPT_LEN,
        "output_tokens": OUTPUT_LEN,
        "policy": "consistent_hash",
    }
