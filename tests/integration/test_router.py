"""The router as a real process with real sim replica processes, over real ZMQ sockets."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest
import zmq

from tests.helpers.aio import with_client
from tests.helpers.procs import wait_for
from toolkit.client import RouterClient, router_status
from toolkit.core.protocol import Generate, Sampling

FAST = ["engine.time_scale=0.05", "router.heartbeat_s=0.2", "router.missed_heartbeats=5"]


def start_cluster(make_run, overrides=(), replicas=None):  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run([*FAST, *overrides])
    stack.start(timeout_s=30)
    return cfg, rd, stack, stack.replicas, stack.frontend


def g(rid: str, prompt: list[int], session: str = "", group: str | None = None, job: str = "j",
      max_tokens: int = 32, deadline: float = 0.0) -> Generate:
    return Generate(rid, job=job, session_id=session or rid, step=0, prompt_token_ids=prompt,
                    sampling=Sampling(max_tokens=max_tokens), group=group, deadline=deadline)


def test_results_route_back_with_groups_and_affinity(make_run) -> None:  # type: ignore[no-untyped-def]
    # A loose load bound: this test is about affinity (the bound is tested in test_policy).
    cfg, rd, procs, reps, address = start_cluster(make_run, ["router.load_factor=100"])

    async def session(c: RouterClient, s: int) -> list:  # type: ignore[type-arg]
        # Turns of one session go one after another, as in a multi-turn rollout.
        return [await c.generate(g(f"r{s}.{t}", [1, 2, s + 3, t], session=f"s{s}")) for t in range(4)]

    async def body(c: RouterClient) -> None:
        # Replica ids carry a random port, so the ring differs per run: with 15 sessions on two
        # replicas, all on one happens once in 2**14 runs (6 sessions failed CI once in ~30).
        per_session = await asyncio.gather(*(session(c, s) for s in range(15)))
        outs = [o for turns in per_session for o in turns]
        assert all(res.status == "ok" and res.output_token_ids for res, _ in outs)
        assert len({res.request_id for res, _ in outs}) == 60
        assert all(route is not None and route.dispatches == 1 for _, route in outs)
        # Consistent hashing keeps each session on one replica, and spreads sessions.
        replicas = [{res.replica_id for res, _ in turns} for turns in per_session]
        assert all(len(r) == 1 for r in replicas), replicas
        assert len(set.union(*replicas)) >= 2
        tail, _ = await c.generate(g("t1", [1, 2, 3], group="tail"))
        assert tail.status == "ok" and tail.group == "tail"

    asyncio.run(with_client(rd, body))


def test_client_errors_fail_at_once_without_an_engine(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, procs, reps, address = start_cluster(make_run, ["engine.max_model_len=64", "engine.vocab_size=1000"])

    async def body(c: RouterClient) -> None:
        long, _ = await c.generate(g("long", list(range(1, 80))))
        assert long.status == "client_error" and "max_model_len 64" in long.error
        oov, _ = await c.generate(g("oov", [1, 5000]))
        assert oov.status == "client_error" and "5000" in oov.error
        grp, _ = await c.generate(g("grp", [1, 2], group="nope"))
        assert grp.status == "client_error" and "throughput" in grp.error
        empty, _ = await c.generate(g("empty", []))
        assert empty.status == "client_error"
        ok, _ = await c.generate(g("fine", [1, 2, 3]))
        assert ok.status == "ok"

    asyncio.run(with_client(rd, body))
    status = router_status(address)
    assert status is not None and status.completed == 5


def test_duplicate_submission_gets_the_same_result(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, procs, reps, address = start_cluster(make_run)

    async def body(c: RouterClient) -> None:
        first, _ = await c.generate(g("dup", [4, 5, 6]))
        second, route = await c.generate(g("dup", [4, 5, 6]))
        assert first == second and route is None

    asyncio.run(with_client(rd, body))


def test_malformed_messages_are_dropped_and_router_keeps_serving(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, procs, reps, address = start_cluster(make_run)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    for frames in ([b"\x03", b"not msgpack"], [b"\xee", b"x"], [b"only-one-frame"], [b"\x01", b"\x90"]):
        s.send_multipart(frames)
    s.close()
    ctx.term()

    async def body(c: RouterClient) -> None:
        res, _ = await c.generate(g("after", [1, 2, 3]))
        assert res.status == "ok"
        # A Generate that does not decode (msgspec encodes floats where ints belong) but whose id can
        # be read: that request fails at once, instead of waiting for an answer that never comes.
        bad = g("floats", [1, 2, 3])
        bad.prompt_token_ids = [1.5, 2.0]  # type: ignore[list-item]
        res, _ = await asyncio.wait_for(c.generate(bad), 10)
        assert res.status == "client_error" and res.error.startswith("bad Generate: Expected `int`"), res.error

    asyncio.run(with_client(rd, body))


@pytest.mark.slow
def test_kill_9_of_a_replica_loses_no_request(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, procs, reps, address = start_cluster(
        make_run, ["engine.time_scale=0.3", "groups=single", "groups.throughput.replicas=2"])
    victim = reps[("throughput", 0)]

    async def body(c: RouterClient) -> None:
        tasks = [asyncio.create_task(c.generate(g(f"k{i}", [1, 2, i + 3], max_tokens=200))) for i in range(40)]

        async def kill_when_busy() -> None:
            while True:
                st = router_status(address, 1.0)
                if st is not None and st.groups["throughput"].inflight >= 20:
                    break
                await asyncio.sleep(0.02)
            os.kill(victim.pid, signal.SIGKILL)

        await kill_when_busy()
        outs = await asyncio.gather(*tasks)
        assert all(res.status == "ok" for res, _ in outs), [res.status for res, _ in outs]
        moved = [route for _, route in outs if route is not None and route.dispatches > 1]
        assert moved, "some requests were in flight on the killed replica and must have been re-dispatched"
        assert all(res.replica_id.startswith("throughput-1@") for (res, route) in outs if route.dispatches > 1)

    t0 = time.monotonic()
    asyncio.run(with_client(rd, body))
    assert time.monotonic() - t0 < 60


def test_a_replica_whose_generation_hangs_never_becomes_ready(make_run) -> None:  # type: ignore[no-untyped-def]
    # The readiness probe's prompt is [1, 2, 3]: this engine hangs on it while its heartbeats go on.
    cfg, rd, procs = make_run([*FAST, "groups=single", "engine.fault_hang_token=2"])
    procs.start_router()
    procs.start_replica("throughput", 0)
    address = json.loads(rd.router_address.read_text())["frontend"]

    def registered() -> bool:
        st = router_status(address, 1.0)
        return st is not None and "throughput" in st.groups and st.groups["throughput"].registered == 1

    wait_for(registered, 30, "registration")
    time.sleep(1.0)  # several heartbeats: they alone must not make it ready
    st = router_status(address, 1.0)
    assert st is not None and st.groups["throughput"].ready == 0


def test_abort_reaches_the_engine_and_frees_the_slot(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, procs, reps, address = start_cluster(
        make_run, ["groups=single", "engine.time_scale=1.0", "engine.output_len_median=100000",
                   "engine.max_model_len=200000"])

    async def body(c: RouterClient) -> None:
        task = asyncio.create_task(c.generate(g("long", [1, 2, 3], max_tokens=100000)))
        await asyncio.sleep(0.3)
        st = router_status(address)
        assert st is not None and st.inflight == 1
        await c.abort("long")
        res, _ = await task
        assert res.status == "cancelled" and res.finish_reason == "abort"
        assert len(res.output_token_ids) > 0  # the engine stopped it mid-way and says how far it got
        st = router_status(address)
        assert st is not None and st.inflight == 0 and st.queued == 0
        # Aborting a request still queued answers at once, without an engine.
        st_before = router_status(address)
        assert st_before is not None
        q = [asyncio.create_task(c.generate(g(f"q{i}", [1, 2, i + 3], max_tokens=100000))) for i in range(65)]
        wait = 0
        while (router_status(address) or st_before).queued < 1 and wait < 100:
            await asyncio.sleep(0.05)
            wait += 1
        await c.abort("q64")
        res, _ = await q[64]
        assert res.status == "cancelled" and "before dispatch" in res.error
        for i in range(64):
            await c.abort(f"q{i}")
        outs = await asyncio.gather(*q[:64])
        assert {res.status for res, _ in outs} == {"cancelled"}
        # An Abort sent before its own Generate (a session closed in the loop pass that queued the
        # call) still cancels it when it comes, instead of leaving it to run to its budget.
        early = asyncio.create_task(c.generate(g("early", [1, 2, 3], max_tokens=100000)))
        await c.abort("early")
        res, _ = await asyncio.wait_for(early, 10)
        assert res.status == "cancelled" and "before it arrived" in res.error

    asyncio.run(with_client(rd, body))


def test_deadline_gives_timeout(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, procs, reps, address = start_cluster(
        make_run, ["groups=single", "engine.time_scale=1.0", "engine.output_len_median=100000",
                   "engine.max_model_len=200000"])

    async def body(c: RouterClient) -> None:
        res, _ = await c.generate(g("slow", [1, 2, 3], max_tokens=100000, deadline=time.time() + 0.5))
        assert res.status == "timeout"
        wait_for(lambda: (router_status(address) or P_none).inflight == 0, 5, "the slot to be freed")

    asyncio.run(with_client(rd, body))


class _NoStatus:
    inflight = -1


P_none = _NoStatus()


def bad_among_good(rd, bad_prompt: list[int], n_good: int, keep_errors: bool = False):  # type: ignore[no-untyped-def]
    """Send ``n_good`` ordinary requests, then one with ``bad_prompt``; return the bad one's Result
    and the good ones' statuses (with ``keep_errors``: (status, error) pairs)."""
    out: dict = {}  # type: ignore[type-arg]

    async def body(c: RouterClient) -> None:
        good = [asyncio.create_task(c.generate(g(f"ok{i}", [1, 2, 100 + i], max_tokens=64)))
                for i in range(n_good)]
        await asyncio.sleep(0.05)
        out["bad"], _ = await c.generate(g("bad", bad_prompt))
        out["good"] = [(res.status, res.error) if keep_errors else res.status for res, _ in await asyncio.gather(*good)]

    asyncio.run(with_client(rd, body))
    return out["bad"], out["good"]


def named_deaths(error: str) -> list[str]:
    """The replicas a request was in flight at when they died, as its engine_dead error names them."""
    return re.findall(r"(throughput-\d+@[^:;()]+:\d+): ", error)


@pytest.mark.slow
def test_poison_request_fails_after_max_engine_deaths_and_the_rest_succeed(make_run) -> None:  # type: ignore[no-untyped-def]
    # A crash is found by the silence it leaves, and on a loaded machine a live replica can fall silent
    # too: the router counts that as a death (its contract). So the deaths are judged by what the router
    # recorded (each death a request was in flight at, named in its error; each drop and why, in its log)
    # and by how each process ended, not by the heartbeats arriving in time.
    cfg, rd, procs, reps, address = start_cluster(
        make_run, ["groups=single", "groups.throughput.replicas=3", "engine.fault_crash_token=7",
                   "engine.time_scale=0.2", "router.policy=round_robin"])
    poison, good = bad_among_good(rd, [1, 7, 3], 30, keep_errors=True)
    assert poison.status == "engine_dead"
    named = named_deaths(poison.error)
    assert len(named) == 2 == len(set(named)), poison.error  # max_engine_deaths: then it kills no more
    ids = {p.pid: f"throughput-{i}" for (_, i), p in reps.items()}
    dead = {ids[p.pid] for p in reps.values() if p.poll() is not None}
    assert all(p.returncode == 70 for p in reps.values() if p.poll() is not None)  # the poison's crash
    drops = dict(re.findall(r"dropping replica (\S+) \((.*?)\) with", rd.log("router").read_text()))
    live_drops = {n for n in drops if n.split("@")[0] not in dead}
    # Each death is a crash of the poison's (the process ended, with 70), or a live replica the router
    # dropped for its silence: never anything else, and no replica died of anything but the poison.
    assert dead <= {n.split("@")[0] for n in named}
    assert all(n.split("@")[0] in dead or drops.get(n, "").startswith("no heartbeat") for n in named), drops
    assert all(drops[n].startswith("no heartbeat") for n in live_drops), drops
    # The live ones dropped came back.
    wait_for(lambda: (st := router_status(address)) is not None and st.groups["throughput"].ready == 3 - len(dead),
             what="the live replicas ready again")
    for status, error in good:
        # A good request fails only for a death no crash caused: it was also on a live replica dropped silent.
        assert status == "ok" or (status == "engine_dead" and set(named_deaths(error)) & live_drops), (status, error)


@pytest.mark.slow
def test_hung_engine_is_dropped_and_its_requests_move(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, procs, reps, address = start_cluster(
        make_run, ["groups=single", "groups.throughput.replicas=3", "engine.fault_hang_token=9",
                   "router.stall_timeout_s=1.0", "router.policy=round_robin"])
    hang, good = bad_among_good(rd, [1, 9, 3], 12)
    assert hang.status == "engine_dead"
    assert good == ["ok"] * 12
    stats = router_status(address)
    assert stats is not None and stats.groups["throughput"].ready == 1  # two hung, dropped, not ready again


def test_jobs_take_turns_on_a_busy_replica(make_run) -> None:  # type: ignore[no-untyped-def]
    # One replica, one request at a time: the dispatch order is the queue's order.
    cfg, rd, procs, reps, address = start_cluster(
        make_run, ["groups=single", "groups.throughput.max_inflight=1", "engine.time_scale=1.0",
                   "engine.output_len_median=100000"])  # every request runs to its max_tokens

    async def body(c: RouterClient) -> None:
        # a0 holds the replica for about a second: A's flood and all of B are queued before the next
        # dispatch, however slowly B's three sends arrive (else B may queue one request at a time).
        a = [asyncio.create_task(c.generate(g(f"a{i}", [1, 2, i + 3], job="A", max_tokens=300 if i == 0 else 16)))
             for i in range(20)]
        await asyncio.sleep(0.2)  # A's flood is queued first
        b = [asyncio.create_task(c.generate(g(f"b{i}", [1, 2, i + 3], job="B", max_tokens=16))) for i in range(3)]
        outs = {res.request_id: route for res, route in await asyncio.gather(*a, *b)}
        order = sorted(outs, key=lambda k: outs[k].dispatched_at)
        positions = [order.index(f"b{i}") for i in range(3)]
        # B waits for at most one of A's requests per turn, not for A's whole backlog.
        first_b = positions[0]
        assert positions == [first_b, first_b + 2, first_b + 4], order
        assert first_b < 8

    asyncio.run(with_client(rd, body))


def test_a_closed_client_says_so_and_closing_never_hides_the_error_being_handled(make_run) -> None:  # type: ignore[no-untyped-def]
    from toolkit.core.errors import RouterUnavailable

    cfg, rd, stack = make_run([])
    stack.start(timeout_s=30)

    async def main() -> None:
        c = RouterClient(rd)
        await c.connect(10)
        # The receiver died of something (here: a socket closed under it): close reports it in the log
        # and still closes the socket and the context.
        c.link.close()
        await asyncio.wait_for(asyncio.wait(c._tasks), 10)
        assert isinstance(c._tasks[0].exception(), RouterUnavailable)
        await c.close()
        assert c.link.closed and c.ctx.closed
        await c.close()  # idempotent
        await c.abort("r1")  # a closed client has nothing to abort through: no error
        with pytest.raises(RouterUnavailable, match="link to the router's frontend is closed"):
            await c.generate(Generate("r1", job="j", prompt_token_ids=[1, 2], sampling=Sampling(max_tokens=2)))

    asyncio.run(asyncio.wait_for(main(), 30))
