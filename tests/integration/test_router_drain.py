"""Elastic scale-down with real router and sim replica processes: drain with and without migration,
a group scaled to zero. The exact messages (a router in a thread, fake replicas) and the router's
bookkeeping: tests/unit/test_router_drain.py."""

from __future__ import annotations

import asyncio
import signal

import pytest

from tests.helpers.aio import with_client
from tests.helpers.requests import gen
from toolkit.client import RouterClient, send_drain
from toolkit.config import Config
from toolkit.core import protocol as P
from toolkit.core.protocol import Generate
from toolkit.engine.plans import plan_output

FAST = ["router.heartbeat_s=0.2", "router.missed_heartbeats=5"]


# Every request runs its whole budget (a huge median length), spread evenly over the replicas.
LONG = ["engine.time_scale=1.0", "engine.output_len_median=100000", "router.policy=round_robin",
        "groups=single", "groups.throughput.replicas=2"]


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
async def long_requests_in_flight(c: RouterClient, n: int) -> tuple[list, list]:  # type: ignore[type-arg]
    """``n`` requests of 300 tokens sent, and every one of them in flight at the router."""
    msgs = [gen(f"m{i}", [1, 2, 50 + i], max_tokens=300) for i in range(n)]
    tasks = [asyncio.create_task(c.generate(m)) for m in msgs]
    await wait_status(c, lambda st: st.inflight == n, "every request in flight")
    return msgs, tasks


@pytest.mark.timeout(180)
def test_drain_with_migrate_moves_inflight_requests_and_the_replica_exits_0(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run([*FAST, *LONG])
    stack.start(timeout_s=60)
    victim = stack.replicas[("throughput", 0)]

    async def body(c: RouterClient) -> None:
        msgs, tasks = await long_requests_in_flight(c, 40)
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
        msgs, tasks = await long_requests_in_flight(c, 20)
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


@pytest.mark.timeout(180)
def test_a_replica_stopped_by_sigterm_hands_its_requests_back_at_once_and_unblamed(make_run) -> None:  # type: ignore[no-untyped-def]
    """A preemption: SIGTERM to a replica with requests in flight. It says it is leaving, so they go back to
    their queues at once and run on the other replica. One engine death would fail each of them
    (``max_engine_deaths=1``), and the heartbeats are too far apart for the router to find the replica
    gone by its silence within the test."""
    cfg, rd, stack = make_run(["router.heartbeat_s=5", "router.missed_heartbeats=20", "router.max_engine_deaths=1",
                               *LONG])
    stack.start(timeout_s=60)
    victim = stack.replicas[("throughput", 0)]

    async def body(c: RouterClient) -> None:
        msgs, tasks = await long_requests_in_flight(c, 8)
        victim.send_signal(signal.SIGTERM)
        outs = await asyncio.gather(*tasks)
        assert [res.status for res, _ in outs] == ["ok"] * 8, [(res.status, res.error) for res, _ in outs]
        moved = [res for res, route in outs if route.dispatches > 1]
        assert len(moved) == 4 and all(res.replica_id.startswith("throughput-1@") for res in moved)

    asyncio.run(with_client(rd, body, timeout_s=90))
    assert victim.wait(timeout=30) is not None
    assert "it is leaving: stopped from outside" in (rd.root / "logs" / "router.log").read_text()
