"""Elastic scale-down: Drain, Shutdown, groups with no replica (toolkit/router/elastic.py).

Real router and sim replica processes for the end-to-end behaviour; a router in a thread with fake
replica sockets for the exact messages (what is aborted, what the continuation asks, when Shutdown
comes and comes again); the router's bookkeeping called directly for the no-replica clock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from tests.conftest import compose_config, wait_for, with_client
from toolkit.client import RouterClient, router_status, send_drain
from toolkit.config import Config
from toolkit.core import protocol as P
from toolkit.core.protocol import Generate, Sampling
from toolkit.core.rundir import RunDir
from toolkit.engine.sim import plan_output
from toolkit.launch.validation import validate
from toolkit.router.server import Router
from toolkit.session.requests import RequestLog

FAST = ["router.heartbeat_s=0.2", "router.missed_heartbeats=5"]
# Every request runs its whole budget (a huge median length), spread evenly over the replicas.
LONG = ["engine.time_scale=1.0", "engine.output_len_median=100000", "router.policy=round_robin",
        "groups=single", "groups.throughput.replicas=2"]


def gen(rid: str, prompt: list[int], max_tokens: int = 32, group: str | None = None) -> Generate:
    return Generate(rid, job="j", session_id=rid, step=0, prompt_token_ids=prompt,
                    sampling=Sampling(max_tokens=max_tokens), group=group)


async def wait_status(c: RouterClient, pred, what: str, timeout_s: float = 30.0) -> P.Status:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        st = await c.status()
        if pred(st):
            return st
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last status {st}")
        await asyncio.sleep(0.05)


def check_full_budget(cfg: Config, msgs: list[Generate], outs: list) -> int:  # type: ignore[type-arg]
    """Every request got its whole budget, exactly the tokens and logprobs the (deterministic) sim
    planned for it, whether or not it moved; returns how many moved."""
    moved = 0
    for m, (res, route) in zip(msgs, outs, strict=True):
        assert res.status == "ok", (m.request_id, res.status, res.error)
        full, full_lp, _ = plan_output(cfg.engine, m)
        assert len(res.output_token_ids) == len(res.logprobs) == m.sampling.max_tokens
        assert res.output_token_ids == full
        assert res.logprobs == pytest.approx(full_lp)
        assert route is not None
        moved += route.dispatches > 1
    return moved


# ---- real processes ------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_drain_with_migrate_moves_inflight_requests_and_the_replica_exits_0(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run([*FAST, *LONG])
    stack.start(timeout_s=60)
    victim = stack.replicas[("throughput", 0)]

    async def body(c: RouterClient) -> None:
        msgs = [gen(f"m{i}", [1, 2, 50 + i], max_tokens=300) for i in range(40)]
        tasks = [asyncio.create_task(c.generate(m)) for m in msgs]
        await wait_status(c, lambda st: st.inflight == 40, "every request in flight")
        st = await asyncio.to_thread(send_drain, stack.frontend, ["throughput-0", "nope-9"])
        assert st is not None
        assert (st.groups["throughput"].draining, st.groups["throughput"].ready) == (1, 1)
        # A resend (launch repeats until the process is gone) changes nothing.
        st = await asyncio.to_thread(send_drain, stack.frontend, ["throughput-0"])
        assert st is not None and st.groups["throughput"].draining == 1
        outs = await asyncio.gather(*tasks)
        moved = check_full_budget(cfg, msgs, outs)
        # Round robin put 20 on the drained replica, each far from done when the drain came.
        assert moved >= 10
        assert all(res.replica_id.startswith("throughput-1@") for res, route in outs if route.dispatches > 1)
        later = [gen(f"l{i}", [1, 2, 200 + i], max_tokens=20) for i in range(10)]
        louts = await asyncio.gather(*(c.generate(m) for m in later))
        assert {res.replica_id.split("@")[0] for res, _ in louts} == {"throughput-1"}
        # Exactly one Result per request: the router completed each once (probes are not counted).
        assert (await c.status()).completed == 50

    asyncio.run(with_client(rd, body, timeout_s=150))
    assert victim.wait(timeout=30) == 0


@pytest.mark.timeout(180)
def test_drain_without_migrate_lets_inflight_requests_finish_there(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run([*FAST, *LONG])
    stack.start(timeout_s=60)
    victim = stack.replicas[("throughput", 0)]

    async def body(c: RouterClient) -> None:
        msgs = [gen(f"m{i}", [1, 2, 50 + i], max_tokens=300) for i in range(20)]
        tasks = [asyncio.create_task(c.generate(m)) for m in msgs]
        await wait_status(c, lambda st: st.inflight == 20, "every request in flight")
        await c.drain(["throughput-0"], migrate=False)
        await wait_status(c, lambda st: st.groups["throughput"].draining == 1, "the drain")
        # New work goes to the other replica only, while the drained one still runs its own.
        later = [gen(f"l{i}", [1, 2, 200 + i], max_tokens=20) for i in range(10)]
        louts = await asyncio.gather(*(c.generate(m) for m in later))
        assert {res.replica_id.split("@")[0] for res, _ in louts} == {"throughput-1"}
        outs = await asyncio.gather(*tasks)
        assert check_full_budget(cfg, msgs, outs) == 0  # nothing moved
        on_victim = [res for res, _ in outs if res.replica_id.startswith("throughput-0@")]
        assert len(on_victim) == 10  # round robin: half of them, finished where they ran
        assert (await c.status()).completed == 30

    asyncio.run(with_client(rd, body, timeout_s=150))
    assert victim.wait(timeout=30) == 0


async def drain_tail_to_zero(c: RouterClient, stack) -> None:  # type: ignore[no-untyped-def]
    """Scale the tail group (one replica) to zero and wait for its process to exit 0."""
    victim = stack.replicas[("tail", 0)]
    await c.drain(["tail-0"])
    await wait_status(c, lambda st: st.groups["tail"].ready == 0, "the tail group to drain")
    assert await asyncio.to_thread(victim.wait, 30) == 0


@pytest.mark.timeout(180)
def test_a_group_scaled_to_zero_waits_for_a_replica_that_joins_later(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run([*FAST, "engine.time_scale=0.05"])
    stack.start(timeout_s=60)

    async def body(c: RouterClient) -> None:
        await drain_tail_to_zero(c, stack)
        waiting = [asyncio.create_task(c.generate(gen(f"t{i}", [1, 2, 3 + i], group="tail"))) for i in range(5)]
        await wait_status(c, lambda st: st.queued == 5, "the tail requests to queue")
        # Other groups serve meanwhile; the tail requests wait (no_replica_timeout_s is 300 s).
        other = await asyncio.gather(*(c.generate(gen(f"o{i}", [1, 2, 3 + i])) for i in range(10)))
        assert {res.status for res, _ in other} == {"ok"} and {res.group for res, _ in other} == {"throughput"}
        assert not any(t.done() for t in waiting)
        stack.start_replica("tail", 1)
        outs = await asyncio.gather(*waiting)
        assert {res.status for res, _ in outs} == {"ok"}
        assert {res.replica_id.split("@")[0] for res, _ in outs} == {"tail-1"}

    asyncio.run(with_client(rd, body, timeout_s=150))


@pytest.mark.timeout(180)
def test_requests_to_an_empty_group_fail_as_no_replica_after_the_timeout(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run([*FAST, "engine.time_scale=0.05", "router.no_replica_timeout_s=0.5"])
    stack.start(timeout_s=60)

    async def body(c: RouterClient) -> None:
        await drain_tail_to_zero(c, stack)
        tail = [asyncio.create_task(c.generate(gen(f"t{i}", [1, 2, 3 + i], group="tail"))) for i in range(3)]
        thr = [asyncio.create_task(c.generate(gen(f"h{i}", [1, 2, 3 + i], group="throughput"))) for i in range(5)]
        anyg = [asyncio.create_task(c.generate(gen(f"a{i}", [1, 2, 3 + i]))) for i in range(10)]
        touts = await asyncio.gather(*tail)
        assert {res.status for res, _ in touts} == {"no_replica"}
        assert all("group tail" in res.error for res, _ in touts)
        others = await asyncio.gather(*thr, *anyg)
        assert {res.status for res, _ in others} == {"ok"}
        assert {res.group for res, _ in others} == {"throughput"}

    asyncio.run(with_client(rd, body, timeout_s=150))


# ---- a router in a thread, fake replicas -----------------------------------------------------------
class RouterThread:
    def __init__(self, cfg: Config, root: Path) -> None:
        rd = RunDir(root)
        rd.make()
        self.ctx = zmq.Context()
        self.router = Router(cfg, rd, self.ctx)
        info = self.router.bind("127.0.0.1")
        self.frontend, self.backend = info["frontend"], info["backend"]
        self._stop = threading.Event()
        # The router's sockets are used only by this thread from here on (thread start is a barrier).
        self.thread = threading.Thread(target=self.router.run, args=(self._stop.is_set,), daemon=True)
        self.thread.start()

    def socket(self, routing_id: str | None = None) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            s.setsockopt(zmq.ROUTING_ID, routing_id.encode())
        s.connect(self.backend if routing_id is not None else self.frontend)
        return s

    def close(self) -> None:
        self._stop.set()
        self.thread.join(10)
        self.router.close()


def recv(sock: zmq.Socket, timeout_s: float = 10.0) -> P.Message:
    assert sock.poll(int(timeout_s * 1000)), "no message"
    frames = sock.recv_multipart()
    return P.decode(frames[0], frames[1])


def quiet(sock: zmq.Socket, timeout_s: float = 0.3) -> bool:
    """Nothing arrives within ``timeout_s`` (for 'no second message' checks; no duration asserted)."""
    return not sock.poll(int(timeout_s * 1000))


class FakeReplica:
    def __init__(self, rt: RouterThread, name: str, max_inflight: int = 4) -> None:
        self.replica_id = f"{name}@testhost:1"
        self.sock = rt.socket(self.replica_id)
        self.register = P.Register(self.replica_id, name.rsplit("-", 1)[0], max_inflight=max_inflight)
        self.send(self.register)

    def send(self, msg: P.Message) -> None:
        self.sock.send_multipart(P.encode(msg))

    def recv(self) -> P.Message:
        return recv(self.sock)

    def become_ready(self) -> None:
        probe = self.recv()
        assert isinstance(probe, P.Generate) and probe.job == "__probe__"
        self.send(P.Result(probe.request_id, output_token_ids=[7], replica_id=self.replica_id))

    def close(self) -> None:
        self.sock.close(0)


@pytest.fixture
def rt(tmp_path: Path) -> Iterator[RouterThread]:
    cfg = compose_config(["groups=single", "router.heartbeat_s=5"])  # the sweep never drops a fake
    validate(cfg)
    r = RouterThread(cfg, tmp_path / "run")
    yield r
    r.close()


def status(rt: RouterThread) -> P.GroupStatus:
    st = router_status(rt.frontend, 5.0, ctx=rt.ctx)
    assert st is not None
    return st.groups["throughput"]


@pytest.mark.timeout(60)
def test_drained_replica_finishes_then_gets_shutdown_again_and_again(rt: RouterThread) -> None:
    a = FakeReplica(rt, "throughput-0")
    a.become_ready()
    client = rt.socket()
    client.send_multipart(P.encode(gen("r1", [1, 2, 3])))
    assert isinstance(m := a.recv(), P.Generate) and m.request_id == "r1"
    st = send_drain(rt.frontend, ["throughput-0", "unknown-3"], migrate=False, ctx=rt.ctx)
    assert st is not None and st.groups["throughput"] == P.GroupStatus(1, 0, 1, 0, 1)
    client.send_multipart(P.encode(gen("r2", [1, 2, 4])))  # nowhere to go: it waits
    assert quiet(a.sock)
    a.send(P.Result("r1", output_token_ids=[5, 6], logprobs=[-1.0, -2.0], replica_id=a.replica_id))
    res = recv(client)
    assert isinstance(res, P.Result) and res.request_id == "r1" and res.output_token_ids == [5, 6]
    assert isinstance(m := a.recv(), P.Shutdown) and m.reason == "drained"
    # Idempotent: a heartbeat, a Drain resend, a re-registration of the retired id.
    a.send(P.Heartbeat(a.replica_id))
    assert isinstance(a.recv(), P.Shutdown)
    send_drain(rt.frontend, ["throughput-0"], ctx=rt.ctx)
    a.send(P.Register(a.replica_id, "throughput"))
    assert isinstance(a.recv(), P.Shutdown)
    assert quiet(a.sock)
    assert status(rt).ready == 0
    # A new replica serves the request that waited.
    b = FakeReplica(rt, "throughput-1")
    b.become_ready()
    assert isinstance(m := b.recv(), P.Generate) and m.request_id == "r2"
    a.close()
    b.close()
    client.close(0)


@pytest.mark.timeout(60)
def test_drain_with_migrate_continues_from_where_it_stopped(rt: RouterThread) -> None:
    a = FakeReplica(rt, "throughput-0")
    a.become_ready()
    client = rt.socket()
    client.send_multipart(P.encode(gen("r1", [1, 2, 3], max_tokens=10)))
    client.send_multipart(P.encode(gen("r2", [1, 2, 4], max_tokens=10)))
    got = {a.recv().request_id, a.recv().request_id}  # type: ignore[attr-defined]
    assert got == {"r1", "r2"}
    client.send_multipart(P.encode(P.Abort("r2")))  # its client aborts it: not to be continued
    assert a.recv() == P.Abort("r2")
    b = FakeReplica(rt, "throughput-1")
    b.become_ready()
    send_drain(rt.frontend, ["throughput-0"], ctx=rt.ctx)
    assert a.recv() == P.Abort("r1")
    assert quiet(a.sock)  # no second abort of r2
    a.send(P.Result("r2", "cancelled", [9], [-0.9], "abort", a.replica_id))
    res2 = recv(client)
    assert isinstance(res2, P.Result) and (res2.request_id, res2.status) == ("r2", "cancelled")
    # Each leg ran across a weight update (update_mode=pause): the merged Result lists every version once, in order.
    a.send(P.Result("r1", "cancelled", [11, 12, 13], [-1.0, -2.0, -3.0], "abort", a.replica_id,
                    weight_version=3, weight_versions=[2, 3]))
    assert isinstance(a.recv(), P.Shutdown)  # it holds nothing now
    cont = b.recv()
    assert isinstance(cont, P.Generate) and cont.request_id == "r1"
    assert cont.prompt_token_ids == [1, 2, 3, 11, 12, 13]
    assert (cont.sampling.max_tokens, cont.resumed_tokens, cont.group) == (7, 3, None)
    b.send(P.Result("r1", "ok", list(range(14, 21)), [-4.0] * 7, "length", b.replica_id, "throughput", 3,
                    weight_version=4, weight_versions=[3, 4]))
    res1 = recv(client)
    assert isinstance(res1, P.Result) and res1.status == "ok"
    assert res1.output_token_ids == [11, 12, 13, *range(14, 21)]
    assert res1.logprobs == [-1.0, -2.0, -3.0] + [-4.0] * 7
    assert res1.weight_versions == [2, 3, 4] and res1.weight_version == 4
    assert res1.replica_id == b.replica_id
    # A late answer from the drained replica is stale: no second Result.
    a.send(P.Result("r1", "ok", [1] * 10, [0.0] * 10, "length", a.replica_id))
    assert quiet(client)
    for f in (a, b):
        f.close()
    client.close(0)


@pytest.mark.timeout(60)
def test_drain_with_migrate_leaves_what_cannot_continue_and_keeps_a_leg_without_logprobs_without(
        rt: RouterThread) -> None:
    a = FakeReplica(rt, "throughput-0")
    a.become_ready()
    client = rt.socket()
    bare = Generate("r1", job="j", session_id="r1", step=0, prompt_token_ids=[1, 2, 3],
                    sampling=Sampling(max_tokens=10, logprobs=False))
    choice = Generate("r2", job="j", session_id="r2", step=0, prompt_token_ids=[1, 2, 4],
                      sampling=Sampling(max_tokens=10, structured=P.Structured(choice=["yes", "no"])))
    for m in (bare, choice):
        client.send_multipart(P.encode(m))
    assert {a.recv().request_id, a.recv().request_id} == {"r1", "r2"}  # type: ignore[attr-defined]
    b = FakeReplica(rt, "throughput-1")
    b.become_ready()
    send_drain(rt.frontend, ["throughput-0"], ctx=rt.ctx)
    assert a.recv() == P.Abort("r1")
    assert quiet(a.sock)  # r2 is constrained by a grammar: it finishes where it runs
    a.send(P.Result("r1", "cancelled", [11, 12, 13], [], "abort", a.replica_id))
    cont = b.recv()
    assert isinstance(cont, P.Generate) and cont.request_id == "r1" and not cont.sampling.logprobs
    b.send(P.Result("r1", "ok", list(range(14, 21)), [], "length", b.replica_id))
    res1 = recv(client)
    assert isinstance(res1, P.Result) and res1.output_token_ids == [11, 12, 13, *range(14, 21)]
    assert res1.logprobs == []  # as an unmoved request without logprobs: none, not zeros
    a.send(P.Result("r2", "ok", [40, 41], [-0.5, -0.5], "stop", a.replica_id))
    res2 = recv(client)
    assert isinstance(res2, P.Result) and res2.request_id == "r2" and res2.output_token_ids == [40, 41]
    assert isinstance(a.recv(), P.Shutdown)
    for f in (a, b):
        f.close()
    client.close(0)


# ---- the router's bookkeeping, called directly -----------------------------------------------------
def test_no_replica_clock_starts_when_both_the_group_and_the_request_wait(tmp_path: Path) -> None:
    cfg = compose_config(["router.no_replica_timeout_s=10"])
    validate(cfg)
    rd = RunDir(tmp_path / "run")
    rd.make()
    router = Router(cfg, rd, zmq.Context())  # never bound: its answers go nowhere, its cache keeps them
    r = P.Register("throughput-0@h:1", "throughput", max_inflight=4)
    router.register(b"t0", r)
    router.pool.set_ready(router.replicas[b"t0"])

    def submit(rid: str, group: str | None, t: float) -> None:
        msg = gen(rid, [1, 2, 3], group=group)
        router.submit(b"c", msg, msgspec.msgpack.encode(msg))
        router.live[rid].t_submit = t

    def status_of(rid: str) -> str | None:
        cached = router.answered.result(rid)
        return P.decode_as(P.Result, cached).status if cached is not None else None

    submit("old", "tail", 900.0)  # waited long, before the tail group was seen empty
    submit("thr", "throughput", 900.0)
    router.check_empty_groups(1000.0)  # tail (and only tail) empty from here
    submit("new", "tail", 1005.0)
    router.check_empty_groups(1009.9)
    assert status_of("old") is None
    router.check_empty_groups(1010.0)
    assert (status_of("old"), status_of("new"), status_of("thr")) == ("no_replica", None, None)
    router.check_empty_groups(1015.0)
    assert status_of("new") == "no_replica" and status_of("thr") is None
    assert router.queue.size == 1  # the throughput request still waits for a free slot
    router.close()


def test_draining_takes_a_replica_out_of_every_count(tmp_path: Path) -> None:
    cfg = compose_config(["groups=single"])
    validate(cfg)
    rd = RunDir(tmp_path / "run")
    rd.make()
    router = Router(cfg, rd, zmq.Context())
    for i in range(2):
        router.register(f"t{i}".encode(), P.Register(f"throughput-{i}@h:1", "throughput", max_inflight=4))
        router.pool.set_ready(router.replicas[f"t{i}".encode()])
    msg = gen("r1", [1, 2, 3])
    router.submit(b"c", msg, msgspec.msgpack.encode(msg))
    router.dispatch()
    req = router.live["r1"]
    a = next(r for r in router.replicas.values() if r.inflight)
    b = next(r for r in router.replicas.values() if r is not a)
    router.drain([a.replica_id.split("@")[0]], migrate=False)
    assert a.draining and not a.shutdown_sent and a.load == 1
    assert router.pool.free["throughput"] == router.pool.free[None] == 4 and router.pool.capacity["throughput"] == 4
    assert router.pool.groups["throughput"] == [b] and list(router.pool.free_sets["throughput"]) == [b]
    router._release(a, req)  # its last request answered: slots stay out, Shutdown goes
    assert router.pool.free[None] == 4 and a.shutdown_sent and a.replica_id in router.retired
    assert router.status().groups["throughput"] == P.GroupStatus(2, 1, 0, 0, 1)
    router.drop(a, "no heartbeat")  # gone after its shutdown: the counts do not move again
    assert router.pool.free[None] == 4 and router.pool.capacity[None] == 4
    router.close()


def test_no_replica_reaches_the_step_report_by_name() -> None:
    # Step reports gather a request's status as its index in STATUSES and name it back from there.
    log = RequestLog()
    log.add(P.Result("r", status="no_replica", error="no ready replica in group tail for 300s"), None, 3, 0.0, 1.0, 0)
    log.add(P.Result("s"), None, 3, 0.0, 1.0, 0)
    codes = log.columns(["throughput", "tail"])["status"].tolist()
    assert [P.STATUSES[c] for c in codes] == ["no_replica", "ok"]


@pytest.mark.timeout(60)
def test_a_groups_token_count_never_jumps_when_a_replica_registers_again(rt: RouterThread) -> None:
    """Counted from heartbeat increments: a replica that registers again reports its engine's lifetime
    total in its first heartbeat, which is a baseline, not new tokens."""
    a = FakeReplica(rt, "throughput-0")
    a.become_ready()

    def beat(n: int) -> None:
        a.send(P.Heartbeat(a.replica_id, generated_tokens=n))

    def seen() -> int:
        return status(rt).generated_tokens

    beat(1000)  # the engine's total so far: the baseline
    beat(1500)
    wait_for(lambda: seen() == 500, 10, "500 tokens")
    a.send(a.register)  # registers again (as with a restarted router)
    a.become_ready()
    beat(2000)
    beat(2100)
    wait_for(lambda: seen() == 600, 10, "100 more")
    beat(40)  # its engine restarted: counts from 0 again
    beat(90)
    wait_for(lambda: seen() == 650, 10, "50 more")
    a.close()
