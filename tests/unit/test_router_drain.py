"""Elastic scale-down: Drain, Shutdown, groups with no replica (toolkit/router/elastic.py).

A router in a thread with fake replica sockets for the exact messages (what is aborted, what the
continuation asks, when Shutdown comes and comes again); the router's bookkeeping called directly for
the no-replica clock. Real router and sim replica processes: tests/integration/test_router_drain.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from tests.helpers.procs import wait_for
from tests.helpers.requests import gen
from tests.helpers.router import FakeReplica, RouterThread, quiet, recv, status
from toolkit.client import send_drain
from toolkit.config import compose_config
from toolkit.core import protocol as P
from toolkit.core.protocol import Generate, Sampling
from toolkit.core.rundir import RunDir
from toolkit.launch.validation import validate
from toolkit.router.replica import Replica
from toolkit.router.server import Router
from toolkit.session.requests import RequestLog


# ---- a router in a thread, fake replicas -----------------------------------------------------------
@pytest.fixture
def rt(tmp_path: Path) -> Iterator[RouterThread]:
    cfg = compose_config(["groups=single", "router.heartbeat_s=5"])  # the sweep never drops a fake
    validate(cfg)
    r = RouterThread(cfg, tmp_path / "run")
    yield r
    r.close()


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
def known(router: Router, ident: bytes) -> Replica:
    r = router.pool.known(ident)
    assert r is not None
    return r


def test_no_replica_clock_starts_when_both_the_group_and_the_request_wait(tmp_path: Path) -> None:
    cfg = compose_config(["router.no_replica_timeout_s=10"])
    validate(cfg)
    rd = RunDir(tmp_path / "run")
    rd.make()
    router = Router(cfg, rd, zmq.Context())  # never bound: its answers go nowhere, its cache keeps them
    r = P.Register("throughput-0@h:1", "throughput", max_inflight=4)
    router.membership.register(b"t0", r)
    router.pool.set_ready(known(router, b"t0"))

    def submit(rid: str, group: str | None, t: float) -> None:
        msg = gen(rid, [1, 2, 3], group=group)
        router.submit(b"c", msg, msgspec.msgpack.encode(msg))
        router.live[rid].t_submit = t

    def status_of(rid: str) -> str | None:
        cached = router.answered.result(rid)
        return P.decode_as(P.Result, cached).status if cached is not None else None

    submit("old", "tail", 900.0)  # waited long, before the tail group was seen empty
    submit("thr", "throughput", 900.0)
    router.empty_groups.check(1000.0)  # tail (and only tail) empty from here
    submit("new", "tail", 1005.0)
    router.empty_groups.check(1009.9)
    assert status_of("old") is None
    router.empty_groups.check(1010.0)
    assert (status_of("old"), status_of("new"), status_of("thr")) == ("no_replica", None, None)
    router.empty_groups.check(1015.0)
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
        router.membership.register(f"t{i}".encode(), P.Register(f"throughput-{i}@h:1", "throughput", max_inflight=4))
        router.pool.set_ready(known(router, f"t{i}".encode()))
    msg = gen("r1", [1, 2, 3])
    router.submit(b"c", msg, msgspec.msgpack.encode(msg))
    router.dispatch()
    req = router.live["r1"]
    a = next(r for r in router.pool.all() if r.inflight)
    b = next(r for r in router.pool.all() if r is not a)
    router.elastic.drain([a.replica_id.split("@")[0]], migrate=False)
    assert a.draining and not a.shutdown_sent and a.load == 1
    pool = router.pool
    assert pool.spare_slots("throughput") == pool.spare_slots(None) == 4 and pool.capacity("throughput") == 4
    assert pool.members("throughput") == [b] and list(pool.with_room("throughput")) == [b]
    router._release(a, req)  # its last request answered: slots stay out, Shutdown goes
    assert pool.spare_slots(None) == 4 and a.shutdown_sent and a.replica_id in router.elastic.retired
    assert router.status().groups["throughput"] == P.GroupStatus(2, 1, 0, 0, 1)
    router.membership.drop(a, "no heartbeat")  # gone after its shutdown: the counts do not move again
    assert pool.spare_slots(None) == 4 and pool.capacity(None) == 4
    router.close()


TailRouter = Callable[..., tuple[Router, Replica, Replica]]


@pytest.fixture
def tail_router(tmp_path: Path) -> Iterator[TailRouter]:
    """``tail_router(*overrides) -> (router, throughput-0, tail-0)``: a router (never bound) with both
    replicas ready and the no-replica timeout at 10 s; closed after the test, failed or not."""
    routers: list[Router] = []

    def make(*overrides: str) -> tuple[Router, Replica, Replica]:
        cfg = compose_config(["router.no_replica_timeout_s=10", *overrides])
        validate(cfg)
        rd = RunDir(tmp_path / "run")
        rd.make()
        router = Router(cfg, rd, zmq.Context())
        routers.append(router)
        for ident, rid, group in ((b"t0", "throughput-0@h:1", "throughput"), (b"l0", "tail-0@h:2", "tail")):
            router.membership.register(ident, P.Register(rid, group, max_inflight=4))
            router.pool.set_ready(known(router, ident))
        return router, known(router, b"t0"), known(router, b"l0")

    yield make
    for router in routers:
        router.close()


def test_a_move_to_a_tail_group_scaled_to_zero_continues_on_the_bulk(tail_router: TailRouter) -> None:
    """``scale tail=0 --finish`` while a long runner is on its way to the tail group: its continuation
    runs on the bulk at once instead of waiting for a tail replica that will not come (and failing
    ``no_replica`` after the timeout)."""
    router, thr, tail = tail_router("tail.policy=age")
    msg = gen("r1", [1, 2, 3], max_tokens=10)
    router.submit(b"c", msg, msgspec.msgpack.encode(msg))
    router.dispatch()
    req = router.live["r1"]
    assert req.replica == thr.replica_id
    router.migrations.start(req, thr, "age", "tail")  # what move_long_runners does with a long runner
    router.elastic.drain(["tail-0"], migrate=False)  # tail=0 --finish: the tail replica holds nothing, it goes
    assert tail.shutdown_sent and router.pool.members("tail") == []
    router.on_backend(thr.identity, *P.encode(P.Result("r1", "cancelled", [11, 12], [-1.0, -2.0], "abort", thr.replica_id)))
    assert req.msg.group == "tail" and req.named_group is None  # the router's choice, not its client's
    router.dispatch()
    assert req.replica == thr.replica_id and req.msg.prompt_token_ids == [1, 2, 3, 11, 12]
    router.empty_groups.check(time.time() + 60)
    assert router.answered.result("r1") is None  # running, not failed
    # A request whose client named the tail group still waits for it (and fails after the timeout).
    named = gen("r2", [1, 2, 4], group="tail")
    router.submit(b"c", named, msgspec.msgpack.encode(named))
    router.dispatch()
    assert router.live["r2"].replica is None


def test_a_flipped_step_goes_on_on_the_bulk_while_the_tail_group_has_no_replica(tail_router: TailRouter) -> None:
    router, thr, tail = tail_router("tail.threshold=0.5")
    router.tail.step_begin("j", 0, 2)
    assert router.tail.session_done("j", 0, "s0") is not None  # 1 of 2 sessions done: the step flips
    first = gen("r1", [1, 2, 3], session="s1")
    router.submit(b"c", first, msgspec.msgpack.encode(first))
    router.dispatch()
    assert router.live["r1"].replica == tail.replica_id  # the rest of the step: to the tail group
    router.membership.drop(tail, "no heartbeat")  # lost: its request waits for a replica again
    router.dispatch()
    assert router.live["r1"].replica == thr.replica_id


def test_no_replica_reaches_the_step_report_by_name() -> None:
    # Step reports gather a request's status as its index in STATUSES and name it back from there.
    log = RequestLog()
    log.add(P.Result("r", status="no_replica", error="no ready replica in group tail for 300s"), None, 3, 0.0, 1.0, 0, 0)
    log.add(P.Result("s"), None, 3, 0.0, 1.0, 0, 0)
    codes = log.columns(["throughput", "tail"])["status"].tolist()
    assert [P.STATUSES[c] for c in codes] == ["no_replica", "ok"]


@pytest.mark.timeout(60)
def test_a_groups_token_count_never_jumps_when_a_replica_registers_again(rt: RouterThread) -> None:
    """Counted from heartbeat increments: a replica that registers again reports its engine's lifetime
    total in its first heartbeat, which is a baseline, not new tokens."""
    a = FakeReplica(rt, "throughput-0")
    a.become_ready()

    def beat(n: int) -> None:
        a.send(P.Heartbeat(a.replica_id, P.ReplicaStats(generated_tokens=n)))

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
