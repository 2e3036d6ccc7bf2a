"""Tail routing with a real router and sim replicas: exact flip, sentinel lifecycle, no spillover,
migration without losing a token."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest

from tests.helpers.aio import with_client
from tests.helpers.procs import wait_for
from tests.helpers.requests import gen as request
from toolkit.client import RouterClient
from toolkit.core.protocol import Generate, Sampling
from toolkit.engine.plans import plan_output

FAST = ["engine.time_scale=0.05", "router.heartbeat_s=0.2"]
# The count flip alone (the seed's behaviour): every group serves a step until its flip.
COUNT = [*FAST, "tail.policy=count", "tail.migrate_inflight=false"]


def gen(rid: str, step: int, prompt: list[int], max_tokens: int = 32, group: str | None = None) -> Generate:
    return request(rid, prompt, max_tokens, step=step, group=group)


async def generated(c: RouterClient) -> int:
    """Tokens the engines generated in all, from the replicas' heartbeats."""
    return sum(g.generated_tokens for g in (await c.status()).groups.values())


async def begin_counting(c: RouterClient, sessions: int) -> int:
    """Step 0 of job ``j`` begins; the tokens generated so far (after the readiness probes' heartbeats)."""
    await asyncio.sleep(0.5)
    before = await generated(c)
    await c.step_begin("j", 0, sessions)
    return before


async def assert_generated_once(c: RouterClient, before: int, want: int) -> None:
    """The engines generated exactly ``want`` tokens since ``before``: every token once (a restart from
    scratch would regenerate a moved request's first leg)."""
    deadline = time.monotonic() + 10
    while (n := await generated(c) - before) < want and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)  # more heartbeats: nothing further arrives
    assert await generated(c) - before == n == want


def test_flip_at_exact_count_and_sentinel_removed_at_each_step_begin(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run([*COUNT, "tail.threshold=0.75"])
    stack.start()
    sentinel = rd.sentinel("j")

    async def body(c: RouterClient) -> None:
        for step in range(2):
            await c.step_begin("j", step, 8)
            # Gone at every step start (removed on the router's file-writer thread, after its writes).
            await asyncio.to_thread(wait_for, lambda: not sentinel.exists(), 10, "the old sentinel removed")
            for i in range(6):  # ceil(0.75 * 8) = 6
                await c.session_done("j", step, f"s{i}")
                if i < 5:
                    await c.session_done("j", step, f"s{i}")  # duplicates do not count twice
                    st = await asyncio.to_thread(lambda: sentinel.exists())
                    assert not st, f"flipped early at {i + 1}"
            await asyncio.to_thread(wait_for, sentinel.exists, 10, "the sentinel")
            info = json.loads(sentinel.read_text())
            assert info["count"] == 6 and info["step"] == step and info["job"] == "j"
            # A stale SessionDone of an older step changes nothing.
            await c.session_done("j", step - 1, "late")

    asyncio.run(with_client(rd, body))


def test_after_the_flip_no_request_of_the_step_reaches_another_group(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run([*COUNT, "tail.threshold=0.5"])
    stack.start()

    async def body(c: RouterClient) -> None:
        await c.step_begin("j", 0, 2)
        before = await asyncio.gather(*(c.generate(gen(f"b{i}", 0, [1, 2, i + 3])) for i in range(30)))
        assert {res.group for res, _ in before} == {"throughput", "tail"}  # all groups serve before
        await c.session_done("j", 0, "s0")
        await asyncio.to_thread(wait_for, rd.sentinel("j").exists, 10, "the flip")
        after = await asyncio.gather(*(c.generate(gen(f"a{i}", 0, [1, 2, i + 3])) for i in range(40)))
        assert {res.group for res, _ in after} == {"tail"}
        # Another step of the job (not flipped) still uses every group.
        other = await asyncio.gather(*(c.generate(gen(f"o{i}", 5, [1, 2, i + 3])) for i in range(30)))
        assert "throughput" in {res.group for res, _ in other}

    asyncio.run(with_client(rd, body))


def test_queued_requests_follow_the_flip(make_run) -> None:  # type: ignore[no-untyped-def]
    # Throughput slots are few and busy: requests queued before the flip must still go to the tail.
    cfg, rd, stack = make_run(["router.heartbeat_s=0.2", "tail.policy=count", "tail.migrate_inflight=false",
                               "tail.threshold=0.5", "engine.time_scale=0.5",
                               "groups.throughput.max_inflight=2", "groups.tail.max_inflight=2"])
    stack.start()

    async def body(c: RouterClient) -> None:
        await c.step_begin("j", 0, 2)
        tasks = [asyncio.create_task(c.generate(gen(f"q{i}", 0, [1, 2, i + 3], max_tokens=64)))
                 for i in range(40)]
        await asyncio.sleep(0.3)
        await c.session_done("j", 0, "s0")
        await asyncio.to_thread(wait_for, rd.sentinel("j").exists, 10, "the flip")
        flip_time = json.loads(rd.sentinel("j").read_text())["time"]
        outs = await asyncio.gather(*tasks)
        after = [res for res, route in outs if route is not None and route.dispatched_at >= flip_time]
        assert len(after) >= 10
        assert {res.group for res in after} == {"tail"}

    asyncio.run(with_client(rd, body))


def test_migrated_requests_lose_no_token(make_run) -> None:  # type: ignore[no-untyped-def]
    cfg, rd, stack = make_run(["router.heartbeat_s=0.2", "tail.policy=count", "tail.threshold=0.5",
                               "tail.migrate_inflight=true", "engine.time_scale=1.0",
                               "engine.output_len_median=100000", "router.policy=round_robin"])
    stack.start()
    sim = cfg.engine

    async def body(c: RouterClient) -> None:
        before = await begin_counting(c, 2)
        longs = [gen(f"long{i}", 0, [1, 2, 50 + i], max_tokens=400) for i in range(6)]
        tasks = [asyncio.create_task(c.generate(m)) for m in longs]
        await asyncio.sleep(0.4)  # ~100 tokens into each
        await c.session_done("j", 0, "s0")
        outs = await asyncio.gather(*tasks)
        moved = 0
        for m, (res, route) in zip(longs, outs, strict=True):
            assert res.status == "ok"
            # The whole budget, once, and exactly what it would have been had it never moved:
            # the first leg's tokens and logprobs, then the tail's continuation of exactly them.
            full, full_lp, _ = plan_output(sim, m)
            assert len(res.output_token_ids) == len(res.logprobs) == 400
            assert res.output_token_ids == full
            assert res.logprobs == pytest.approx(full_lp)
            if route is not None and route.dispatches == 2:
                moved += 1
                assert res.group == "tail"
        assert moved >= 2  # round robin put four of six on throughput replicas
        # The continuations started where the first legs stopped.
        await assert_generated_once(c, before, 6 * 400)

    asyncio.run(with_client(rd, body))
    stack.stop()
    timeline = json.loads(rd.timeline("j", 0).read_text())
    assert timeline["migrated"] >= 2
    assert set(timeline["dispatched_after_flip"]) == {"tail"}


def test_a_long_runner_moves_before_any_flip_with_every_token_once(make_run) -> None:  # type: ignore[no-untyped-def]
    # age: a turn past 60 tokens moves to the tail group at once; the count flip (0.9 of 10 sessions)
    # never comes, as no session reports done.
    cfg, rd, stack = make_run(["router.heartbeat_s=0.2", "tail.policy=age", "tail.long_tokens=60",
                               "tail.threshold=0.9", "engine.time_scale=1.0", "engine.output_len_median=100000"])
    stack.start()
    sim = cfg.engine

    async def body(c: RouterClient) -> None:
        before = await begin_counting(c, 10)
        # The step's first turn finds the tail group's room idle and starts there; once a turn of the
        # step has ended, the tail group takes only long runners.
        opener, route = await c.generate(gen("opener", 0, [1, 2, 3], max_tokens=5))
        assert route is not None and (opener.status, opener.group, route.moves) == ("ok", "tail", 0)
        longs = [gen(f"long{i}", 0, [1, 2, 50 + i], max_tokens=400) for i in range(4)]
        shorts = [gen(f"short{i}", 0, [1, 2, 80 + i], max_tokens=30) for i in range(6)]
        outs = await asyncio.gather(*(c.generate(m) for m in [*longs, *shorts]))
        for m, (res, route) in zip([*longs, *shorts], outs, strict=True):
            assert res.status == "ok" and route is not None
            full, full_lp, _ = plan_output(sim, m)
            # Every token once, and exactly what it would have been had it never moved.
            assert res.output_token_ids == full and res.logprobs == pytest.approx(full_lp)
            if m in longs:
                assert (len(full), route.moves, route.dispatches, res.group) == (400, 1, 2, "tail")
            else:  # short turns never reach 60 tokens: they stay on the throughput group
                assert (len(full), route.moves, res.group) == (30, 0, "throughput")
        assert not rd.sentinel("j").exists()  # it moved before (and without) any flip
        await assert_generated_once(c, before, 5 + 4 * 400 + 6 * 30)

    asyncio.run(with_client(rd, body))
    stack.stop()
    stats = json.loads(rd.router_stats.read_text())
    assert stats["migrated:age"] == 4 and "migrated" not in stats
    timeline = json.loads(rd.timeline("j", 0).read_text())
    assert timeline["migrated"] == 4 and timeline["flip_time"] is None


def test_a_turn_hinted_long_starts_on_the_tail_group_and_never_moves(make_run) -> None:  # type: ignore[no-untyped-def]
    # age with a 60-token long turn: a hint above it starts the turn on the tail group (2 places);
    # unhinted turns and turns hinted short start on the throughput group and move once they pass 60.
    cfg, rd, stack = make_run(["router.heartbeat_s=0.2", "tail.policy=age", "tail.long_tokens=60",
                               "tail.threshold=null", "engine.time_scale=1.0", "engine.output_len_median=100000",
                               "groups.tail.max_inflight=2"])
    stack.start()
    sim = cfg.engine

    async def body(c: RouterClient) -> None:
        before = await begin_counting(c, 6)
        hinted = [msgspec.structs.replace(gen(f"hinted{i}", 0, [1, 2, 50 + i], max_tokens=200), expected_tokens=200)
                  for i in range(2)]
        short = [msgspec.structs.replace(gen(f"short{i}", 0, [1, 2, 80 + i], max_tokens=30), expected_tokens=30)
                 for i in range(2)]
        plain = [gen(f"plain{i}", 0, [1, 2, 90 + i], max_tokens=30) for i in range(2)]
        outs = await asyncio.gather(*(c.generate(m) for m in [*hinted, *short, *plain]))
        for m, (res, route) in zip([*hinted, *short, *plain], outs, strict=True):
            assert res.status == "ok" and route is not None
            assert res.output_token_ids == plan_output(sim, m)[0]
            want = ("tail", 1, 0) if m in hinted else ("throughput", 1, 0)
            assert (res.group, route.dispatches, route.moves) == want, m.request_id
        await assert_generated_once(c, before, 2 * 200 + 4 * 30)

    asyncio.run(with_client(rd, body))
    stack.stop()
    assert "migrated:age" not in json.loads(rd.router_stats.read_text())


def test_the_speed_weighted_ring_keeps_a_sessions_turns_on_one_replica_within_a_step(make_run) -> None:  # type: ignore[no-untyped-def]
    # No tail routing: every group's replica is on the one ring of the step's sessions.
    cfg, rd, stack = make_run(["router.heartbeat_s=0.1", "router.policy=consistent_hash", "engine.time_scale=0.5",
                               "engine.output_len_median=100000", "tail.policy=count", "tail.threshold=null"])
    stack.start()

    async def turns(c: RouterClient, step: int, n: int) -> dict[str, list[str]]:
        """Two turns of each of ``n`` sessions, one request at a time: the ring alone decides."""
        where: dict[str, list[str]] = {}
        for i in range(n):
            for turn in range(2):
                m = Generate(f"{step}/s{i}/{turn}", job="j", session_id=f"s{i}", step=step,
                             prompt_token_ids=[1, 2, 3 + i, turn], sampling=Sampling(max_tokens=2))
                res, _ = await c.generate(m)
                assert res.status == "ok"
                where.setdefault(f"s{i}", []).append(res.replica_id)
        return where

    async def body(c: RouterClient) -> None:
        await c.step_begin("j", 0, 40)
        before = await turns(c, 0, 40)  # no speed known yet: an even ring
        # Load every replica so the router learns their peak rates (the TP-2 replica is faster per
        # request, the TP-1 ones hold 4x the requests).
        load = [gen(f"load{i}", 0, [9, 9, 9, i], max_tokens=300, group=g)
                for i, g in enumerate(["throughput"] * 80 + ["tail"] * 16)]
        await asyncio.gather(*(c.generate(m) for m in load))
        status = await c.status()
        assert all(g.peak_tokens_per_s > 0 for g in status.groups.values())
        await c.step_begin("j", 1, 40)  # a step boundary: the ring takes in the speeds
        after = await turns(c, 1, 40)
        assert all(len(set(w)) == 1 for w in after.values()), after  # both turns on one replica
        assert all(len(set(w)) == 1 for w in before.values()), before
        moved = [s for s in after if after[s][0] != before[s][0]]
        assert moved, "the ring did not change with the learned speeds"

    asyncio.run(with_client(rd, body))


def turn(session: str, k: int, step: int, max_tokens: int) -> Generate:
    return Generate(f"{session}/{k}", job="j", session_id=session, step=step,
                    prompt_token_ids=[1, 2, 3, 40 + hash(session) % 50, k], sampling=Sampling(max_tokens=max_tokens))


@pytest.mark.parametrize("move", ["recompute", "kv"])
def test_a_long_runner_trades_places_with_a_session_in_its_last_turn_with_every_token_once(make_run, move: str) -> None:  # type: ignore[no-untyped-def]
    """Step 0 shows sessions of three turns. In step 1 the tail group's 2 places hold the last turns of
    sessions x0 and x1 (their turns stay there); session y's first turn, on the bulk, passes the
    long-turn limit with two turns still to come: it takes x0's or x1's place, which goes on on the bulk."""
    cfg, rd, stack = make_run(["router.heartbeat_s=0.2", "tail.policy=age", "tail.long_tokens=60",
                               "tail.trade_margin=0", f"tail.move={move}", "groups.tail.max_inflight=2",
                               "engine.time_scale=1.0", "engine.output_len_median=100000"])
    stack.start()
    sim = cfg.engine

    async def body(c: RouterClient) -> None:
        before = await begin_counting(c, 2)
        for k in range(3):  # step 0: two sessions of three 20-token turns
            await asyncio.gather(*(c.generate(turn(s, k, 0, 20)) for s in ("s0", "s1")))
        await c.step_begin("j", 1, 3)
        for k in range(2):  # the step's first turns start on the tail group; their sessions stay there
            for res, route in await asyncio.gather(*(c.generate(turn(s, k, 1, 5)) for s in ("x0", "x1"))):
                assert (res.status, res.group, route.moves) == ("ok", "tail", 0)
        last = [turn(s, 2, 1, 600) for s in ("x0", "x1")]
        runner = turn("y", 0, 1, 600)
        tasks = [asyncio.ensure_future(c.generate(m)) for m in last]
        await asyncio.sleep(0.3)  # both run on the tail group: it is full
        outs = await asyncio.gather(c.generate(runner), *tasks)
        for m, (res, _) in zip([runner, *last], outs, strict=True):
            full, full_lp, _ = plan_output(sim, m)
            assert res.status == "ok" and res.output_token_ids == full and res.logprobs == pytest.approx(full_lp)
        (y, y_route), *residents = outs
        assert (y.group, y_route.moves) == ("tail", 1)
        # The one traded out falls behind on the bulk, a long runner there: once the other ends, it moves
        # back into the place that frees.
        assert sorted((res.group, route.moves) for res, route in residents) == [("tail", 0), ("tail", 2)]
        await assert_generated_once(c, before, 6 * 20 + 4 * 5 + 3 * 600)

    asyncio.run(with_client(rd, body))
    stack.stop()
    stats = json.loads(rd.router_stats.read_text())
    assert stats["migrated:trade"] == 1 and stats["migrated:age"] == 2
