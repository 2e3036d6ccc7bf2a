"""The router under faults, in-process (a real ``Router``, its calls driven by the test, no socket):
garbled frames, reserved ids and bad deadlines, replicas that die, leave or come back at the wrong
moment, and what its queue keeps. Every request gets exactly one Result, and none is lost."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.helpers.router import RecordingLinks, answer, ready_replica, router_in_process, submit
from toolkit.core import clock
from toolkit.core import protocol as P
from toolkit.router.server import Router


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def vclock() -> Iterator[_Clock]:
    c = _Clock()
    with clock.virtual(c, 1.7e9):
        yield c


def _router(tmp_path: Path, *overrides: str) -> tuple[Router, RecordingLinks]:
    return router_in_process(tmp_path / "run", ["groups=single", *overrides])


def _results(links: RecordingLinks) -> list[tuple[str, str]]:
    return [(r.request_id, r.status) for r in (P.decode_as(P.Result, frames[1]) for _, frames in links.to_clients
                                                 if frames[0] == P.TYPE_OF[P.Result])]


def _sent(links: RecordingLinks, since: int = 0) -> list[str]:
    return [m.request_id for _, m in links.to_replicas[since:]
            if isinstance(m, P.Generate) and not m.request_id.startswith("__probe__")]


def _generate(router: Router, rid: str, **fields: object) -> None:
    msg = P.Generate(rid, job="j", prompt_token_ids=[1, 2, 3], **fields)  # type: ignore[arg-type]
    router.submit(b"client", msg, P.encode(msg)[1])


def test_a_garbled_generate_fails_alone_and_never_answers_a_request_twice(tmp_path: Path) -> None:
    router, links = _router(tmp_path)
    r = ready_replica(router, "throughput-0@h:1", "throughput", 4)
    # Arrays nested past Python's limit: a protocol error (dropped, counted), not the router's end.
    with pytest.raises(P.ProtocolError):
        router.on_frontend(b"client", P.TYPE_OF[P.Generate], b"\x91" * 200_000 + b"\x00")
    submit(router, "x", [1, 2, 3])
    router.dispatch()
    garbled = msgspec.msgpack.encode(["x", "j", "", -1, [1, 2.5, 3]])  # a resend of live "x", a float among its ids
    with pytest.raises(P.ProtocolError):
        router.on_frontend(b"client", P.TYPE_OF[P.Generate], garbled)
    assert _results(links) == []  # "x" runs: its one Result comes from its replica
    answer(router, r, "x", [7])
    with pytest.raises(P.ProtocolError):
        router.on_frontend(b"client", P.TYPE_OF[P.Generate], garbled)  # answered: its Result again
    with pytest.raises(P.ProtocolError):
        router.on_frontend(b"client", P.TYPE_OF[P.Generate], msgspec.msgpack.encode(["y", "j", "", -1, [2.5]]))
    assert _results(links) == [("x", "ok"), ("x", "ok"), ("y", "client_error")]


def test_reserved_ids_and_deadlines_that_are_no_time_fail_at_once(tmp_path: Path, vclock: _Clock) -> None:
    """A client id in the probes' namespace would be taken for a probe's answer (never answered, a slot
    held for good); a NaN deadline would sit at the root of the deadlines' heap and stop every other."""
    router, links = _router(tmp_path)
    _generate(router, "__probe__:mine")
    _generate(router, "nan", deadline=math.nan)
    _generate(router, "inf", deadline=math.inf)
    _generate(router, "a", deadline=clock.wall() + 1)
    vclock.t += 100  # no replica: "a" waits in the queue, past its deadline
    router.sweep()
    got = dict(_results(links))
    assert got == {"__probe__:mine": "client_error", "nan": "client_error", "inf": "client_error", "a": "timeout"}
    assert not router.live


def test_a_replica_drained_while_it_loads_weights_is_not_put_in_service_by_its_late_acknowledgement(
        tmp_path: Path, vclock: _Clock) -> None:
    router, links = _router(tmp_path)
    a = ready_replica(router, "throughput-0@h:1", "throughput", 2)
    router.weights.update(b"trainer", P.UpdateWeights("/ck/v1", 1))
    router.on_backend(a.identity, *P.encode(P.WeightsUpdated(1, a.replica_id)))
    ib = b"throughput-1@h:2"
    router.on_backend(ib, *P.encode(P.Register("throughput-1@h:2", "throughput", max_inflight=2)))
    b = router.pool.known(ib)
    assert b is not None
    probe = [m for i, m in links.to_replicas if i == ib and isinstance(m, P.Generate)][-1]
    router.on_backend(ib, *P.encode(P.Result(probe.request_id, output_token_ids=[1], replica_id=b.replica_id)))
    assert not b.ready  # it serves once it holds v1
    router.elastic.drain(["throughput-1"], True)
    router.on_backend(ib, *P.encode(P.WeightsUpdated(1, b.replica_id)))  # its load ends after the drain
    router.on_backend(ib, *P.encode(P.Leaving("drained")))
    assert not b.ready and b not in router.pool.members("throughput") and router.pool.capacity("throughput") == 2
    for i in range(6):
        submit(router, f"q{i}", [1, 2, 3, i], session=f"s{i}")
    router.dispatch()
    assert not b.inflight and set(a.inflight) == {"q0", "q1"}
    while router.live:
        for rid in list(a.inflight):
            answer(router, a, rid, [5])
        router.dispatch()
    assert sorted(rid for rid, status in _results(links) if status == "ok") == [f"q{i}" for i in range(6)]


def test_a_dead_replicas_requests_go_back_in_order_beside_the_rest_and_an_aborted_one_ends(tmp_path: Path) -> None:
    """Suspects are placed one to a replica: in a bucket of their own, they never hold back the job's
    other requests, and they go back in the order they came."""
    router, links = _router(tmp_path)
    a = ready_replica(router, "throughput-0@h:1", "throughput", 4)
    for i in range(4):
        submit(router, f"s{i}", [1, 2, 3])
    router.dispatch()
    router.abort("s3")  # its client gave up on it: an Abort is on its way to the replica
    b = ready_replica(router, "throughput-1@h:1", "throughput", 4)
    for i in range(8):
        submit(router, f"n{i}", [1, 2, 3])
    router.dispatch()
    for rid in list(b.inflight):
        answer(router, b, rid, [9])
    n = len(links.to_replicas)
    router.membership.drop(a, "killed")
    router.dispatch()
    # One suspect on the one live replica, the oldest; the rest of the job beside it.
    assert _sent(links, n) == ["s0", "n4", "n5", "n6"]
    assert ("s3", "cancelled") in _results(links)  # not run again: nobody waits for it
    c = ready_replica(router, "throughput-2@h:1", "throughput", 4)
    n = len(links.to_replicas)
    router.dispatch()
    assert _sent(links, n) == ["s1", "n7"]  # the next suspect in order ("s1" before "s2"), then the rest
    assert c.suspects == 1


def test_a_result_that_does_not_decode_leaves_its_request_where_it_was(tmp_path: Path) -> None:
    router, links = _router(tmp_path)
    r = ready_replica(router, "throughput-0@h:1", "throughput", 4)
    submit(router, "x", [1, 2, 3])
    router.dispatch()
    with pytest.raises(P.ProtocolError):
        router.on_backend(r.identity, P.TYPE_OF[P.Result], msgspec.msgpack.encode(["x", "ok", None]))
    assert "x" in r.inflight  # still its replica's: answered by it, or requeued at its death
    router.membership.drop(r, "killed")
    assert router.queue.size == 1


def test_dispatch_goes_on_past_a_round_that_only_failed_requests(tmp_path: Path) -> None:
    router, links = _router(tmp_path)
    submit(router, "long", list(range(1, 200)))  # no replica yet: no limit known at submit
    submit(router, "short", [1, 2, 3])
    r = ready_replica(router, "throughput-0@h:1", "throughput", 4, max_model_len=100)
    router.dispatch()
    assert _results(links) == [("long", "client_error")] and list(r.inflight) == ["short"]


def test_requests_taken_out_of_the_queue_leave_its_depths_and_its_memory(tmp_path: Path, vclock: _Clock) -> None:
    router, _ = _router(tmp_path, "router.no_replica_timeout_s=10")
    for i in range(1000):
        submit(router, f"q{i}", [1, 2, 3])
    router.sweep()
    vclock.t += 11
    router.sweep()  # all fail as no_replica: nothing would ever dispatch them
    assert router.queue.depths() == [("j", 0)]
    for i in range(1000, 1500):
        submit(router, f"q{i}", [1, 2, 3])
    for i in range(1000, 1500, 2):
        router.abort(f"q{i}")
    assert router.queue.size == 250 and router.queue.depths() == [("j", 250)]
    held = sum(len(b) for b in router.queue.jobs["j"].buckets.values())
    assert held <= 2 * 250 + 65  # the taken-out ones are dropped once they outnumber the rest


def test_a_moved_request_that_fits_nowhere_it_may_go_ends_with_its_tokens(tmp_path: Path) -> None:
    """A tail group of a shorter ``max_model_len``: the continuation ends at the limit, as an engine ends a
    sequence there; not failed as the client's error with its tokens lost."""
    router, links = router_in_process(tmp_path / "run", ["groups=default", "tail.policy=age"])
    bulk = ready_replica(router, "throughput-0@h:1", "throughput", 4, max_model_len=8192)
    ready_replica(router, "tail-0@h:2", "tail", 4, max_model_len=2048)
    router.tail.step_begin("j", 0, 10)
    router.tail.records["j"].lengths.add(10)  # a turn finished: new turns go to the bulk group
    msg = P.Generate("r1", job="j", session_id="s1", prompt_token_ids=[1] * 1500,
                     sampling=P.Sampling(max_tokens=4000, logprobs=True))
    router.submit(b"client", msg, P.encode(msg)[1])
    router.dispatch()
    req = router.live["r1"]
    assert req.replica == bulk.replica_id
    router.migrations.start(req, bulk, "age", "tail")
    router.on_backend(bulk.identity, *P.encode(P.Result("r1", status="cancelled", output_token_ids=[2] * 1000,
                                                        logprobs=[-0.5] * 1000, replica_id=bulk.replica_id,
                                                        weight_version=0)))
    router.dispatch()
    [(_, frames)] = [x for x in links.to_clients if x[1][0] == P.TYPE_OF[P.Result]]
    res = P.decode_as(P.Result, frames[1])
    assert (res.status, res.finish_reason, len(res.output_token_ids), len(res.logprobs)) == ("ok", "length", 1000, 1000)
    assert not router.live and router.stats["ended_at_move"] == 1


def test_a_second_call_with_the_id_of_a_request_in_flight_shares_its_result(tmp_path: Path) -> None:
    """``RouterClient.generate``: a caller that gives up on an id leaves the other caller of that id its Result."""
    from toolkit.client import RouterClient
    from toolkit.core.rundir import RunDir

    async def main() -> bool:
        rd = RunDir(tmp_path / "run")
        rd.make()
        client = RouterClient(rd)
        sent: list[P.Message] = []

        async def send(msg: P.Message) -> None:
            sent.append(msg)

        client._send = send  # type: ignore[method-assign]
        try:
            msg = P.Generate("x", job="j", prompt_token_ids=[1, 2, 3])
            first = asyncio.ensure_future(client.generate(msg))
            second = asyncio.ensure_future(client.generate(msg))
            await asyncio.sleep(0)
            first.cancel()
            await asyncio.sleep(0)
            client.pending["x"][1].set_result((P.Result("x"), None))
            res, _ = await asyncio.wait_for(second, 5)
            return res.request_id == "x" and len(sent) == 1 and not client.pending
        finally:
            client.link.close()
            client.ctx.term()

    assert asyncio.run(main())


def test_a_stall_of_the_routers_own_loop_does_not_make_its_replicas_look_dead(tmp_path: Path) -> None:
    """Replicas beat throughout a stall of the router's thread (a long pass, a descheduled process): the
    sweep after it reads their heartbeats before it judges their silence."""
    import threading
    import time

    from tests.helpers.router import FakeReplica, RouterThread
    from toolkit.config import compose_config

    rt = RouterThread(compose_config(["groups=single", "router.heartbeat_s=0.2", "router.missed_heartbeats=5"]),
                      tmp_path / "run")
    replicas = [FakeReplica(rt, f"throughput-{i}", max_inflight=2) for i in range(2)]
    stop = threading.Event()
    try:
        for f in replicas:
            f.become_ready()
        stall = threading.Event()
        submit = rt.router.submit

        def stalling_submit(*args: object) -> None:  # the router's thread stops while it takes "q" in
            submit(*args)  # type: ignore[arg-type]
            stall.set()
            time.sleep(2.0)  # twice the silence that drops a replica (5 x 0.2 s)

        rt.router.submit = stalling_submit  # type: ignore[method-assign]
        lock = threading.Lock()

        def beat() -> None:
            while not stop.wait(0.05):
                with lock:
                    for f in replicas:
                        f.send(P.Heartbeat(f.replica_id))

        beater = threading.Thread(target=beat, daemon=True)
        beater.start()
        client = rt.socket()
        client.send_multipart(P.encode(P.Generate("q", job="j", prompt_token_ids=[1, 2, 3])))
        assert stall.wait(30), "the router never took the request in"
        time.sleep(3.0)  # the stall (2 s from its start) and sweeps after it
        stop.set()
        beater.join(5)
        assert len(rt.router.pool.all()) == 2 and rt.router.stats["requeued"] == 0
    finally:
        stop.set()
        rt.close()
        for f in replicas:
            f.close()


def test_a_router_away_longer_than_two_heartbeats_does_not_count_that_time_as_silence(tmp_path: Path,
                                                                                         vclock: _Clock) -> None:
    """Between two checks the router was not running (descheduled on a loaded node): what the replicas sent
    meanwhile may still sit in the kernel's buffers, unread. That time, beyond a heartbeat, is not their
    silence nor their stall; a replica that stays silent after is dropped as before."""
    router, _ = _router(tmp_path, "router.heartbeat_s=0.2", "router.missed_heartbeats=5",
                        "router.stall_timeout_s=2.0")
    a, b = (ready_replica(router, f"throughput-{i}@h:{i}", "throughput", 2) for i in range(2))
    submit(router, "x", [1, 2, 3])
    router.dispatch()
    router.sweep()
    vclock.t += 3.0  # the router's absence: past the silence (1 s) and the stall (2 s) that drop a replica
    router.sweep()
    assert set(router.pool.all()) == {a, b} and router.events()["router_absences"] == 1
    for _ in range(6):  # sweeps as often as the router makes them, a heartbeat from "a" alone
        vclock.t += 0.2
        router.membership.heartbeat(a.identity, P.Heartbeat(a.replica_id))
        router.sweep()
    assert [r.replica_id for r in router.pool.all()] == [a.replica_id]  # "b" silent since the return: dropped
    assert router.events()["router_absences"] == 1
    # A router away at every check (0.5 s apart, its heartbeat 0.2 s) still finds a dead replica: only the
    # time beyond a heartbeat is credited, so "a", silent from now, is dropped after five checks, not never.
    if "x" in a.inflight:
        answer(router, a, "x", [5])  # (its silence alone is judged here)
    checks = 0
    while router.pool.all() and checks < 8:
        vclock.t += 0.5
        router.sweep()
        checks += 1
    assert not router.pool.all() and checks == 6 and router.events()["router_absences"] == 1 + checks


def test_a_poison_requests_error_names_every_death_it_was_in_flight_at(tmp_path: Path) -> None:
    router, links = _router(tmp_path, "router.max_engine_deaths=2")
    a, b, c = (ready_replica(router, f"throughput-{i}@h:{i}", "throughput", 1) for i in range(3))
    submit(router, "p", [1, 2, 3])
    router.dispatch()
    first = next(r for r in (a, b, c) if r.inflight)
    router.membership.drop(first, "no heartbeat for 1.0s")
    router.dispatch()
    second = next(r for r in router.pool.all() if r.inflight)
    router.on_backend(second.identity, *P.encode(P.Result("p", status="engine_dead", error="EngineDeadError()",
                                                          replica_id=second.replica_id)))
    [res] = [P.decode_as(P.Result, frames[1]) for _, frames in links.to_clients]
    assert res.status == "engine_dead"
    assert res.error == (f"in flight at 2 engine deaths ({first.replica_id}: no heartbeat for 1.0s; "
                         f"{second.replica_id}: EngineDeadError())"), res.error
